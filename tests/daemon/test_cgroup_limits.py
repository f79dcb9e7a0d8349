"""Container limits in hardware detection: cgroup v2 and v1 memory and CPU limits, and the CPU affinity.

psutil reports the host's RAM and cores; inside a container or a Kubernetes pod (``resources.limits.memory: 8Gi``
on a 128 GiB node) corral would budget the host's memory and be OOM-killed, and start llama.cpp with a thread per
host core under a 2-CPU quota. ``daemon.hardware`` reads the process's cgroups (own and ancestors) and its affinity
and caps what ``detect()`` and ``SystemMemoryProbe.free_ram()`` report. Every test here
builds a fake ``/sys/fs/cgroup`` tree and ``/proc/self/cgroup`` under tmp_path, and fakes psutil's numbers where
``detect()`` is asked, so the results do not depend on the machine running them.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from daemon import hardware
from daemon.hardware import (
    CgroupLimits,
    SystemMemoryProbe,
    budgets,
    describe,
    detect,
    read_cgroup_limits,
)

GiB = 1 << 30
MiB = 1 << 20
V1_NO_LIMIT = 9223372036854771712  # what cgroup v1 writes for "no limit" on x86-64 (PAGE_COUNTER_MAX pages)


def tree(tmp_path: Path, proc: str, files: dict[str, str | int]) -> tuple[Path, Path]:
    """A fake cgroup mount (``files``: path under it -> content) and /proc/self/cgroup (``proc``)."""
    root = tmp_path / "cgroup"
    root.mkdir(parents=True, exist_ok=True)
    for rel, content in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"{content}\n")
    proc_file = tmp_path / "proc-self-cgroup"
    proc_file.write_text(proc)
    return root, proc_file


def stat(inactive: int, key: str = "inactive_file") -> str:
    return f"anon 123\nfile 456\nactive_file 789\n{key} {inactive}\nunevictable 0"


# -- cgroup v2 ---------------------------------------------------------------------------------------------------
POD = "kubepods.slice/kubepods-pod1.slice/cri-containerd-abc.scope"


def test_v2_limit_on_the_process_own_cgroup(tmp_path: Path) -> None:
    root, proc = tree(
        tmp_path,
        f"0::/{POD}\n",
        {
            f"{POD}/memory.max": 8 * GiB,
            f"{POD}/memory.current": 2 * GiB,
            f"{POD}/memory.stat": stat(0),
        },
    )
    lim = read_cgroup_limits(root, proc)
    assert lim.memory_max == 8 * GiB
    assert lim.memory_headroom == 6 * GiB
    assert lim.memory_max_source == f"memory.max ({root / POD})"
    assert lim.cpu_quota is None


def test_v2_memory_high_is_a_limit_too(tmp_path: Path) -> None:
    """systemd's MemoryHigh= (v2 memory.high): above it the cgroup is throttled; the smaller of it and memory.max."""
    files: dict[str, str | int] = {
        f"{POD}/memory.max": 8 * GiB,
        f"{POD}/memory.high": 6 * GiB,
        f"{POD}/memory.current": 2 * GiB,
        f"{POD}/memory.stat": stat(0),
    }
    root, proc = tree(tmp_path, f"0::/{POD}\n", files)
    lim = read_cgroup_limits(root, proc)
    assert lim.memory_max == 6 * GiB and lim.memory_headroom == 4 * GiB
    assert lim.memory_max_source == f"memory.high ({root / POD})"
    (root / POD / "memory.high").write_text("max\n")
    assert read_cgroup_limits(root, proc).memory_max == 8 * GiB


def test_v2_limit_on_a_parent_slice_only(tmp_path: Path) -> None:
    parent = "kubepods.slice/kubepods-pod1.slice"
    root, proc = tree(
        tmp_path,
        f"0::/{POD}\n",
        {
            f"{POD}/memory.max": "max",
            f"{POD}/memory.current": 1 * GiB,
            f"{parent}/memory.max": 4 * GiB,
            f"{parent}/memory.current": 3 * GiB,
            f"{parent}/memory.stat": stat(0),
            f"{parent}/cpu.max": "200000 100000",
            f"{POD}/cpu.max": "max 100000",
        },
    )
    lim = read_cgroup_limits(root, proc)
    assert lim.memory_max == 4 * GiB and str(root / parent) in lim.memory_max_source
    assert lim.memory_headroom == 1 * GiB  # the parent's usage counts (its other children use it too)
    assert lim.cpu_quota == 2.0 and str(root / parent) in lim.cpu_quota_source


def test_v2_the_smallest_limit_and_the_smallest_headroom_win_each_on_its_own(tmp_path: Path) -> None:
    """The container's limit is the lower one, but its parent (the pod, with another container) has less left."""
    parent = "kubepods.slice/kubepods-pod1.slice"
    root, proc = tree(
        tmp_path,
        f"0::/{POD}\n",
        {
            f"{POD}/memory.max": 2 * GiB,
            f"{POD}/memory.current": 512 * MiB,  # 1.5 GiB left in the container
            f"{parent}/memory.max": 4 * GiB,
            f"{parent}/memory.current": 3584 * MiB,  # 0.5 GiB left in the pod
            f"{POD}/cpu.max": "150000 100000",
            f"{parent}/cpu.max": "100000 100000",
        },
    )
    lim = read_cgroup_limits(root, proc)
    assert lim.memory_max == 2 * GiB and lim.memory_max_source.endswith(f"{POD})")
    assert lim.memory_headroom == 512 * MiB and lim.memory_headroom_source.endswith(f"{parent})")
    assert lim.cpu_quota == 1.0


def test_v2_max_everywhere_is_no_limit(tmp_path: Path) -> None:
    root, proc = tree(
        tmp_path,
        "0::/user.slice/user-1000.slice/session-2.scope\n",
        {
            "user.slice/user-1000.slice/session-2.scope/memory.max": "max",
            "user.slice/user-1000.slice/session-2.scope/memory.current": 5 * GiB,
            "user.slice/user-1000.slice/session-2.scope/cpu.max": "max 100000",
            "user.slice/user-1000.slice/memory.max": "max",
            "user.slice/memory.max": "max",
            "user.slice/cpu.max": "max 100000",
            # the root cgroup has no memory.max nor cpu.max
            "memory.stat": stat(GiB),
        },
    )
    assert read_cgroup_limits(root, proc) == CgroupLimits()


def test_v2_inactive_file_is_not_counted_as_used(tmp_path: Path) -> None:
    """Page cache the kernel can drop (inactive_file) is room, not use: usage 7 GiB of which 3 GiB inactive cache
    leaves 4 GiB of an 8 GiB limit."""
    root, proc = tree(
        tmp_path,
        "0::/\n",  # a container with its own cgroup namespace: its cgroup is the mount's root
        {"memory.max": 8 * GiB, "memory.current": 7 * GiB, "memory.stat": stat(3 * GiB)},
    )
    assert read_cgroup_limits(root, proc).memory_headroom == 4 * GiB
    # more inactive cache than usage (the numbers are read at different moments): never more room than the limit
    (root / "memory.stat").write_text(stat(9 * GiB))
    assert read_cgroup_limits(root, proc).memory_headroom == 8 * GiB
    # a limit with no readable usage: the limit itself is the most there can be
    (root / "memory.current").unlink()
    assert read_cgroup_limits(root, proc).memory_headroom == 8 * GiB
    # used beyond the limit (swap, or a limit lowered under the usage): no room, not a negative one
    (root / "memory.current").write_text(f"{9 * GiB}\n")
    (root / "memory.stat").write_text(stat(0))
    assert read_cgroup_limits(root, proc).memory_headroom == 0


@pytest.mark.parametrize(
    ("content", "cpus"),
    [
        ("200000 100000", 2.0),
        ("50000 100000", 0.5),
        ("150000 100000", 1.5),
        ("400000 50000", 8.0),
        ("max 100000", None),
        ("max", None),
    ],
)
def test_v2_cpu_max(tmp_path: Path, content: str, cpus: float | None) -> None:
    root, proc = tree(tmp_path, "0::/app\n", {"app/cpu.max": content})
    assert read_cgroup_limits(root, proc).cpu_quota == cpus


def test_v2_on_a_hybrid_system_is_read_under_unified(tmp_path: Path) -> None:
    root, proc = tree(
        tmp_path,
        "4:memory:/\n0::/app\n",
        {"memory/memory.limit_in_bytes": V1_NO_LIMIT, "unified/app/memory.max": 3 * GiB, "unified/app/cpu.max": "1"},
    )
    assert read_cgroup_limits(root, proc).memory_max == 3 * GiB


# -- cgroup v1 ---------------------------------------------------------------------------------------------------
V1_PROC = (
    "12:pids:/docker/abc\n"
    "4:memory:/docker/abc\n"
    "3:cpu,cpuacct:/docker/abc\n"
    "2:cpuset:/docker/abc\n"
    "1:name=systemd:/docker/abc\n"
    "0::/system.slice/containerd.service\n"
)


def test_v1_memory_and_cpu(tmp_path: Path) -> None:
    root, proc = tree(
        tmp_path,
        V1_PROC,
        {
            "memory/docker/abc/memory.limit_in_bytes": 6 * GiB,
            "memory/docker/abc/memory.usage_in_bytes": 3 * GiB,
            "memory/docker/abc/memory.stat": stat(256 * MiB, "inactive_file")
            + f"\ntotal_inactive_file {GiB}",  # the hierarchical count is the one used
            "memory/docker/memory.limit_in_bytes": V1_NO_LIMIT,
            "memory/memory.limit_in_bytes": V1_NO_LIMIT,
            "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": 300000,
            "cpu,cpuacct/docker/abc/cpu.cfs_period_us": 100000,
            "cpu,cpuacct/cpu.cfs_quota_us": -1,
            "cpu,cpuacct/cpu.cfs_period_us": 100000,
        },
    )
    lim = read_cgroup_limits(root, proc)
    assert lim.memory_max == 6 * GiB
    assert lim.memory_max_source == f"memory.limit_in_bytes ({root / 'memory/docker/abc'})"
    assert lim.memory_headroom == 4 * GiB
    assert lim.cpu_quota == 3.0 and lim.cpu_quota_source.startswith("cpu.cfs_quota_us (")


def test_v1_unlimited_sentinel_and_no_quota(tmp_path: Path) -> None:
    root, proc = tree(
        tmp_path,
        "4:memory:/user.slice\n3:cpu,cpuacct:/user.slice\n",
        {
            "memory/user.slice/memory.limit_in_bytes": V1_NO_LIMIT,
            "memory/user.slice/memory.usage_in_bytes": 20 * GiB,
            "memory/memory.limit_in_bytes": 1 << 60,
            "cpu,cpuacct/user.slice/cpu.cfs_quota_us": -1,
            "cpu,cpuacct/user.slice/cpu.cfs_period_us": 100000,
        },
    )
    assert read_cgroup_limits(root, proc) == CgroupLimits()


def test_v1_container_path_not_under_the_mount_uses_the_mount_root(tmp_path: Path) -> None:
    """In a container /proc/self/cgroup names the host's path (/docker/abc) while the container's mount shows its
    own cgroup at the root: the limits are read there."""
    root, proc = tree(
        tmp_path,
        "4:memory:/docker/abc\n2:cpu:/docker/abc\n",
        {
            "memory/memory.limit_in_bytes": 2 * GiB,
            "memory/memory.usage_in_bytes": GiB,
            "memory/memory.stat": stat(512 * MiB, "total_inactive_file"),
            "cpu/cpu.cfs_quota_us": 50000,
            "cpu/cpu.cfs_period_us": 100000,
        },
    )
    lim = read_cgroup_limits(root, proc)
    assert lim.memory_max == 2 * GiB and lim.memory_max_source == f"memory.limit_in_bytes ({root / 'memory'})"
    assert lim.memory_headroom == 2 * GiB - 512 * MiB
    assert lim.cpu_quota == 0.5


def test_v1_cpu_controller_mounted_under_another_name(tmp_path: Path) -> None:
    """/proc/self/cgroup says cpuacct,cpu but the mount (or its symlink) is cpu,cpuacct."""
    root, proc = tree(
        tmp_path,
        "3:cpuacct,cpu:/\n",
        {"cpu,cpuacct/cpu.cfs_quota_us": 400000, "cpu,cpuacct/cpu.cfs_period_us": 100000},
    )
    assert read_cgroup_limits(root, proc).cpu_quota == 4.0


# -- what is not there, or not sense ------------------------------------------------------------------------------
def test_no_cgroups_at_all_is_no_limits(tmp_path: Path) -> None:
    """macOS and Windows: neither /sys/fs/cgroup nor /proc/self/cgroup."""
    assert read_cgroup_limits(tmp_path / "no-sys", tmp_path / "no-proc") == CgroupLimits()
    root, proc = tree(tmp_path, "", {})
    assert read_cgroup_limits(root, proc) == CgroupLimits()


@pytest.mark.parametrize(
    "files",
    [
        {"app/memory.max": "lots", "app/cpu.max": "a b"},
        {"app/memory.max": "", "app/cpu.max": ""},
        {"app/memory.max": "-1", "app/cpu.max": "100000"},
        {"app/memory.max": "0", "app/cpu.max": "0 100000"},
        {"app/memory.max": "1.5e9", "app/cpu.max": "100000 0"},
        {"app/memory.max": "8589934592 extra", "app/cpu.max": "-100000 100000"},
        {"app/memory.max/oops": "a directory, not a file", "app/cpu.max/oops": "same"},
    ],
)
def test_garbage_files_set_no_limit(tmp_path: Path, files: dict[str, str | int]) -> None:
    root, proc = tree(tmp_path, "0::/app\n", files)
    assert read_cgroup_limits(root, proc) == CgroupLimits()


def test_garbage_usage_and_stat_are_ignored_not_the_limit(tmp_path: Path) -> None:
    root, proc = tree(
        tmp_path,
        "garbage line\n\n4:memory:/x\n0::/app\n",
        {"app/memory.max": 4 * GiB, "app/memory.current": "many", "app/memory.stat": "inactive_file lots\nnonsense"},
    )
    lim = read_cgroup_limits(root, proc)
    assert lim.memory_max == 4 * GiB and lim.memory_headroom == 4 * GiB
    (root / "app/memory.current").write_text(f"{GiB}\n")
    assert read_cgroup_limits(root, proc).memory_headroom == 3 * GiB  # unreadable inactive_file: 0


def test_unreadable_proc_file_and_a_path_outside_the_namespace(tmp_path: Path) -> None:
    root, proc = tree(tmp_path, "0::/../../user.slice\n", {"memory.max": 5 * GiB, "user.slice/memory.max": GiB})
    assert read_cgroup_limits(root, proc).memory_max == 5 * GiB  # only the namespace's root is read
    assert read_cgroup_limits(root, tmp_path / "proc-dir-missing") == CgroupLimits()
    assert read_cgroup_limits(root, tmp_path) == CgroupLimits()  # a directory where the file should be


# -- detect(), budgets(), free_ram() ----------------------------------------------------------------------------
@pytest.fixture
def big_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """psutil as on a 128 GiB node with 32 cores / 64 threads, 115 GiB available."""
    vm = SimpleNamespace(total=128 * GiB, available=115 * GiB)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: vm)
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 64 if logical else 32)


def _detect(root: Path, proc: Path, tmp_path: Path, affinity: int | None = None) -> hardware.Hardware:
    return detect(
        check_offload=False,
        environ={},
        nvml=lambda: ((), "no NVML"),
        cache_dir=tmp_path / "cache",
        use_cache=False,
        cgroup_root=root,
        proc_cgroup=proc,
        affinity=lambda: affinity,
    )


def test_detect_in_a_pod_with_8gi_and_2_cpus(tmp_path: Path, big_node: None) -> None:
    root, proc = tree(
        tmp_path,
        f"0::/{POD}\n",
        {
            f"{POD}/memory.max": 8 * GiB,
            f"{POD}/memory.current": 3 * GiB,
            f"{POD}/memory.stat": stat(GiB),
            f"{POD}/cpu.max": "200000 100000",
        },
    )
    hw = _detect(root, proc, tmp_path, affinity=64)
    assert hw.total_ram == 8 * GiB
    assert hw.available_ram == 6 * GiB  # 8 GiB less (3 GiB used less 1 GiB of droppable cache)
    assert (hw.logical_cores, hw.physical_cores) == (2, 2)
    assert hw.limits == (
        f"cgroup memory.max 8.0 GiB ({root / POD})",
        f"cgroup memory free 6.0 GiB (memory.max less the cgroup's usage, reclaimable page cache not counted) "
        f"({root / POD})",
        f"cpu.max quota 2.0 CPUs ({root / POD})",
    )
    assert hw.to_json()["limits"] == list(hw.limits)
    lines = describe(hw, budgets(hw, None, None))
    assert lines[0].startswith("cpu physical_cores=2 logical_cores=2 ram_total=8589934592 ram_available=6442450944")
    assert lines[1] == "limits " + "; ".join(hw.limits)
    b = budgets(hw, None, None)
    assert b.ram == 5 * GiB  # free RAM less the reserve (max(1 GiB, 10% of 8 GiB)): within the limit
    assert b.ram <= 8 * GiB - 3 * GiB + GiB


def test_detect_fractional_quota_rounds_up_and_affinity_caps(tmp_path: Path, big_node: None) -> None:
    root, proc = tree(tmp_path, "0::/app\n", {"app/cpu.max": "50000 100000"})
    hw = _detect(root, proc, tmp_path, affinity=4)
    assert (hw.logical_cores, hw.physical_cores) == (1, 1)
    assert hw.limits == ("CPU affinity 4 of 64", f"cpu.max quota 0.5 CPUs ({root / 'app'})")
    assert (hw.total_ram, hw.available_ram) == (128 * GiB, 115 * GiB)

    root2, proc2 = tree(tmp_path / "b", "0::/app\n", {"app/cpu.max": "max 100000"})
    hw = _detect(root2, proc2, tmp_path, affinity=4)  # taskset -c 0-3 on a 64-thread node
    assert (hw.logical_cores, hw.physical_cores) == (4, 4)
    assert hw.limits == ("CPU affinity 4 of 64",)
    hw = _detect(root2, proc2, tmp_path, affinity=48)
    assert (hw.logical_cores, hw.physical_cores) == (48, 32)  # physical cores stay the machine's when fewer


def test_detect_with_limits_above_the_machine_changes_nothing(tmp_path: Path, big_node: None) -> None:
    root, proc = tree(
        tmp_path,
        "0::/app\n",
        {"app/memory.max": 512 * GiB, "app/memory.current": GiB, "app/cpu.max": "12800000 100000"},
    )
    hw = _detect(root, proc, tmp_path, affinity=None)  # None: the OS has no affinity (macOS)
    assert (hw.total_ram, hw.available_ram, hw.logical_cores, hw.physical_cores) == (128 * GiB, 115 * GiB, 64, 32)
    assert hw.limits == () and hw.to_json()["limits"] == []
    assert not any(line.startswith("limits") for line in describe(hw, budgets(hw, None, None)))


def test_detect_headroom_alone_caps_available(tmp_path: Path, big_node: None) -> None:
    """A limit above the node's RAM, but the cgroup already uses most of it: available is what is left."""
    root, proc = tree(
        tmp_path, "0::/app\n", {"app/memory.max": 200 * GiB, "app/memory.current": 190 * GiB, "app/memory.stat": ""}
    )
    hw = _detect(root, proc, tmp_path)
    assert (hw.total_ram, hw.available_ram) == (128 * GiB, 10 * GiB)
    assert len(hw.limits) == 1 and hw.limits[0].startswith("cgroup memory free 10.0 GiB (memory.max less")


def test_free_ram_is_capped_by_the_headroom_read_afresh(tmp_path: Path, big_node: None) -> None:
    root, proc = tree(tmp_path, "0::/app\n", {"app/memory.max": 8 * GiB, "app/memory.current": 2 * GiB})
    probe = SystemMemoryProbe(environ={}, nvml=lambda: ((), ""), cgroup_root=root, proc_cgroup=proc)
    assert probe.free_ram() == 6 * GiB
    (root / "app/memory.current").write_text(f"{7 * GiB}\n")  # a model was loaded
    assert probe.free_ram() == GiB
    (root / "app/memory.max").write_text("max\n")
    assert probe.free_ram() == 115 * GiB
    no_cgroups = SystemMemoryProbe(environ={}, nvml=lambda: ((), ""), proc_cgroup=tmp_path / "none")
    assert no_cgroups.free_ram() == 115 * GiB


def test_the_real_machine_never_raises() -> None:
    """Whatever this machine has (cgroups v1, v2, hybrid, none), reading it gives numbers, not an exception."""
    lim = read_cgroup_limits()
    assert lim.memory_max is None or lim.memory_max > 0
    hw = hardware.detect(check_offload=False, use_cache=False)
    assert 1 <= hw.physical_cores <= hw.logical_cores
    affinity = hardware.cpu_affinity()
    assert affinity is None or affinity >= 1
    assert 0 <= SystemMemoryProbe().free_ram() <= psutil.virtual_memory().total


def test_corral_info_shows_the_limits() -> None:
    from cli.commands.ps import info_lines

    data = {"hardware": {"physical_cores": 2, "logical_cores": 2, "limits": ["cgroup memory.max 8.0 GiB (/x)"]}}
    shown = "\n".join(info_lines(data))
    assert "Limits" in shown and "cgroup memory.max 8.0 GiB (/x)" in shown
    assert "Limits" not in "\n".join(info_lines({"hardware": {"physical_cores": 2}}))
