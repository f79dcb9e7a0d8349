"""What the routes read from the app's state: the one :class:`~daemon.generation.inference.Inference` that
``create_app`` builds (model lookup, options, leases), shared by every dialect without one route importing another."""

from __future__ import annotations

from fastapi import Request

from daemon.generation.inference import Inference


def inference(request: Request) -> Inference:
    """The app's :class:`Inference`."""
    inf: Inference = request.app.state.inference
    return inf
