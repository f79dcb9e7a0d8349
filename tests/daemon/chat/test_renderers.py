"""The family renderers: each family's prompt text for the same few chats, written out in full (from the families'
published chat templates, as Ollama's renderers emit them), plus the edge cases each family has."""

# The expected prompts are written out line by line as the model sees them; some lines are long.
# ruff: noqa: E501

from __future__ import annotations

import datetime
from typing import Any

import pytest

from daemon.chat.renderers import harmony, names, renderer_for
from daemon.chat.renderers.base import Renderer
from daemon.chat.types import Message, ThinkValue, Tool
from errors import InvalidRequest


def render(
    renderer: Renderer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, think: ThinkValue
) -> str:
    """The renderer's prompt for a chat written in Ollama's wire shape (as the fixtures below are)."""
    return renderer.render(
        [Message.of(m) for m in messages], [Tool.of(t) for t in tools] if tools is not None else None, think
    )


WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather",
        "parameters": {
            "type": "object",
            "required": ["city"],
            "properties": {
                "city": {"type": "string", "description": "The city"},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
        },
    },
}
SYS_USER: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
# An assistant tool call (with its thinking), the tool's result, and then the next generation prompt.
CALL: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "thinking": "Need weather.",
        "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "content": "18C", "tool_name": "get_weather"},
]
PREFILL: list[dict[str, Any]] = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]

CASES: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None, bool | None]] = {
    "sys_user": (SYS_USER, None, None),
    "think_on": (SYS_USER, None, True),
    "think_off": (SYS_USER, None, False),
    "tools": (SYS_USER, [WEATHER], None),
    "call": (CALL, [WEATHER], True),
    "prefill": (PREFILL, None, None),
}

EXPECTED: dict[tuple[str, str], str] = {
    ("qwen3-coder", "sys_user"): (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ),
    ("qwen3-coder", "tools"): (
        "<|im_start|>system\n"
        "Be brief.\n"
        "\n"
        "# Tools\n"
        "\n"
        "You have access to the following functions:\n"
        "\n"
        "<tools>\n"
        "<function>\n"
        "<name>get_weather</name>\n"
        "<description>Get the weather</description>\n"
        "<parameters>\n"
        "<parameter>\n"
        "<name>city</name>\n"
        "<type>string</type>\n"
        "<description>The city</description>\n"
        "</parameter>\n"
        "<parameter>\n"
        "<name>unit</name>\n"
        "<type>string</type>\n"
        '<enum>["c","f"]</enum>\n'
        "</parameter>\n"
        '<required>["city"]</required>\n'
        "</parameters>\n"
        "</function>\n"
        "</tools>\n"
        "\n"
        "If you choose to call a function ONLY reply in the following format with NO suffix:\n"
        "\n"
        "<tool_call>\n"
        "<function=example_function_name>\n"
        "<parameter=example_parameter_1>\n"
        "value_1\n"
        "</parameter>\n"
        "<parameter=example_parameter_2>\n"
        "This is the value for the second parameter\n"
        "that can span\n"
        "multiple lines\n"
        "</parameter>\n"
        "</function>\n"
        "</tool_call>\n"
        "\n"
        "<IMPORTANT>\n"
        "Reminder:\n"
        "- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
        "- Required parameters MUST be specified\n"
        "- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n"
        "- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n"
        "</IMPORTANT><|im_end|>\n"
        "<|im_start|>user\n"
        "Hi<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    ("qwen3-coder", "call"): (
        "<|im_start|>system\n"
        "You are Qwen, a helpful AI assistant that can interact with a computer to solve tasks.\n"
        "\n"
        "# Tools\n"
        "\n"
        "You have access to the following functions:\n"
        "\n"
        "<tools>\n"
        "<function>\n"
        "<name>get_weather</name>\n"
        "<description>Get the weather</description>\n"
        "<parameters>\n"
        "<parameter>\n"
        "<name>city</name>\n"
        "<type>string</type>\n"
        "<description>The city</description>\n"
        "</parameter>\n"
        "<parameter>\n"
        "<name>unit</name>\n"
        "<type>string</type>\n"
        '<enum>["c","f"]</enum>\n'
        "</parameter>\n"
        '<required>["city"]</required>\n'
        "</parameters>\n"
        "</function>\n"
        "</tools>\n"
        "\n"
        "If you choose to call a function ONLY reply in the following format with NO suffix:\n"
        "\n"
        "<tool_call>\n"
        "<function=example_function_name>\n"
        "<parameter=example_parameter_1>\n"
        "value_1\n"
        "</parameter>\n"
        "<parameter=example_parameter_2>\n"
        "This is the value for the second parameter\n"
        "that can span\n"
        "multiple lines\n"
        "</parameter>\n"
        "</function>\n"
        "</tool_call>\n"
        "\n"
        "<IMPORTANT>\n"
        "Reminder:\n"
        "- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
        "- Required parameters MUST be specified\n"
        "- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n"
        "- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n"
        "</IMPORTANT><|im_end|>\n"
        "<|im_start|>user\n"
        "Weather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n"
        "\n"
        "<tool_call>\n"
        "<function=get_weather>\n"
        "<parameter=city>\n"
        "Paris\n"
        "</parameter>\n"
        "</function>\n"
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n"
        "<tool_response>\n"
        "18C\n"
        "</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    ("qwen3-coder", "prefill"): ("<|im_start|>user\nCount<|im_end|>\n<|im_start|>assistant\n1, 2,"),
    ("qwen3.5", "sys_user"): (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    ),
    ("qwen3.5", "think_on"): (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    ),
    ("qwen3.5", "think_off"): (
        "<|im_start|>system\n"
        "Be brief.<|im_end|>\n"
        "<|im_start|>user\n"
        "Hi<|im_end|>\n"
        "<|im_start|>assistant\n"
        "<think>\n"
        "\n"
        "</think>\n"
        "\n"
    ),
    ("qwen3.5", "tools"): (
        "<|im_start|>system\n"
        "# Tools\n"
        "\n"
        "You have access to the following functions:\n"
        "\n"
        "<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "Get the weather", "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string", "description": "The city"}, "unit": {"type": "string", "enum": ["c", "f"]}}}}}\n'
        "</tools>\n"
        "\n"
        "If you choose to call a function ONLY reply in the following format with NO suffix:\n"
        "\n"
        "<tool_call>\n"
        "<function=example_function_name>\n"
        "<parameter=example_parameter_1>\n"
        "value_1\n"
        "</parameter>\n"
        "<parameter=example_parameter_2>\n"
        "This is the value for the second parameter\n"
        "that can span\n"
        "multiple lines\n"
        "</parameter>\n"
        "</function>\n"
        "</tool_call>\n"
        "\n"
        "<IMPORTANT>\n"
        "Reminder:\n"
        "- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
        "- Required parameters MUST be specified\n"
        "- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n"
        "- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n"
        "</IMPORTANT>\n"
        "\n"
        "Be brief.<|im_end|>\n"
        "<|im_start|>user\n"
        "Hi<|im_end|>\n"
        "<|im_start|>assistant\n"
        "<think>\n"
    ),
    ("qwen3.5", "call"): (
        "<|im_start|>system\n"
        "# Tools\n"
        "\n"
        "You have access to the following functions:\n"
        "\n"
        "<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "Get the weather", "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string", "description": "The city"}, "unit": {"type": "string", "enum": ["c", "f"]}}}}}\n'
        "</tools>\n"
        "\n"
        "If you choose to call a function ONLY reply in the following format with NO suffix:\n"
        "\n"
        "<tool_call>\n"
        "<function=example_function_name>\n"
        "<parameter=example_parameter_1>\n"
        "value_1\n"
        "</parameter>\n"
        "<parameter=example_parameter_2>\n"
        "This is the value for the second parameter\n"
        "that can span\n"
        "multiple lines\n"
        "</parameter>\n"
        "</function>\n"
        "</tool_call>\n"
        "\n"
        "<IMPORTANT>\n"
        "Reminder:\n"
        "- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
        "- Required parameters MUST be specified\n"
        "- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n"
        "- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n"
        "</IMPORTANT><|im_end|>\n"
        "<|im_start|>user\n"
        "Weather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n"
        "<think>\n"
        "Need weather.\n"
        "</think>\n"
        "\n"
        "<tool_call>\n"
        "<function=get_weather>\n"
        "<parameter=city>\n"
        "Paris\n"
        "</parameter>\n"
        "</function>\n"
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n"
        "<tool_response>\n"
        "18C\n"
        "</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
        "<think>\n"
    ),
    ("qwen3.5", "prefill"): ("<|im_start|>user\nCount<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n1, 2,"),
    ("qwen3-vl-instruct", "sys_user"): (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ),
    ("qwen3-vl-instruct", "think_on"): (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    ),
    ("qwen3-vl-instruct", "think_off"): (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ),
    ("qwen3-vl-instruct", "tools"): (
        "<|im_start|>system\n"
        "Be brief.\n"
        "\n"
        "# Tools\n"
        "\n"
        "You may call one or more functions to assist with the user query.\n"
        "\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        "<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "Get the weather", "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string", "description": "The city"}, "unit": {"type": "string", "enum": ["c", "f"]}}}}}\n'
        "</tools>\n"
        "\n"
        "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
        "<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n"
        "Hi<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    ("qwen3-vl-instruct", "call"): (
        "<|im_start|>system\n"
        "# Tools\n"
        "\n"
        "You may call one or more functions to assist with the user query.\n"
        "\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        "<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "Get the weather", "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string", "description": "The city"}, "unit": {"type": "string", "enum": ["c", "f"]}}}}}\n'
        "</tools>\n"
        "\n"
        "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
        "<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n"
        "Weather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n"
        "<think>\n"
        "Need weather.\n"
        "</think>\n"
        "\n"
        "<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n"
        "<tool_response>\n"
        "18C\n"
        "</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
        "<think>\n"
    ),
    ("qwen3-vl-instruct", "prefill"): ("<|im_start|>user\nCount<|im_end|>\n<|im_start|>assistant\n1, 2,"),
    ("qwen3-vl-thinking", "sys_user"): (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    ),
    ("qwen3-vl-thinking", "think_on"): (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    ),
    ("qwen3-vl-thinking", "think_off"): (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ),
    ("qwen3-vl-thinking", "tools"): (
        "<|im_start|>system\n"
        "Be brief.\n"
        "\n"
        "# Tools\n"
        "\n"
        "You may call one or more functions to assist with the user query.\n"
        "\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        "<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "Get the weather", "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string", "description": "The city"}, "unit": {"type": "string", "enum": ["c", "f"]}}}}}\n'
        "</tools>\n"
        "\n"
        "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
        "<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n"
        "Hi<|im_end|>\n"
        "<|im_start|>assistant\n"
        "<think>\n"
    ),
    ("qwen3-vl-thinking", "call"): (
        "<|im_start|>system\n"
        "# Tools\n"
        "\n"
        "You may call one or more functions to assist with the user query.\n"
        "\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        "<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "Get the weather", "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string", "description": "The city"}, "unit": {"type": "string", "enum": ["c", "f"]}}}}}\n'
        "</tools>\n"
        "\n"
        "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
        "<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n"
        "Weather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n"
        "<think>\n"
        "Need weather.\n"
        "</think>\n"
        "\n"
        "<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n"
        "<tool_response>\n"
        "18C\n"
        "</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
        "<think>\n"
    ),
    ("qwen3-vl-thinking", "prefill"): (
        "<|im_start|>user\nCount<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n1, 2,"
    ),
    ("deepseek3.1", "sys_user"): ("<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜></think>"),
    ("deepseek3.1", "think_on"): ("<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜><think>"),
    ("deepseek3.1", "think_off"): ("<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜></think>"),
    ("deepseek3.1", "tools"): (
        "<｜begin▁of▁sentence｜>Be brief.\n"
        "\n"
        "## Tools\n"
        "You have access to the following tools:\n"
        "\n"
        "### get_weather\n"
        "Description: Get the weather\n"
        "\n"
        'Parameters: {"type":"object","required":["city"],"properties":{"city":{"type":"string","description":"The city"},"unit":{"type":"string","enum":["c","f"]}}}\n'
        "\n"
        "IMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜>{{additional_tool_calls}}<｜tool▁calls▁end｜>\n"
        "\n"
        "Where:\n"
        "\n"
        "- `tool_call_name` must be an exact match to one of the available tools\n"
        "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
        "- For multiple tool calls, chain them directly without separators or spaces\n"
        "<｜User｜>Hi<｜Assistant｜></think>"
    ),
    ("deepseek3.1", "call"): (
        "<｜begin▁of▁sentence｜>\n"
        "\n"
        "## Tools\n"
        "You have access to the following tools:\n"
        "\n"
        "### get_weather\n"
        "Description: Get the weather\n"
        "\n"
        'Parameters: {"type":"object","required":["city"],"properties":{"city":{"type":"string","description":"The city"},"unit":{"type":"string","enum":["c","f"]}}}\n'
        "\n"
        "IMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜>{{additional_tool_calls}}<｜tool▁calls▁end｜>\n"
        "\n"
        "Where:\n"
        "\n"
        "- `tool_call_name` must be an exact match to one of the available tools\n"
        "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
        "- For multiple tool calls, chain them directly without separators or spaces\n"
        '<｜User｜>Weather in Paris?<｜Assistant｜></think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city":"Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜tool▁output▁begin｜>18C<｜tool▁output▁end｜>'
    ),
    ("deepseek3.1", "prefill"): ("<｜begin▁of▁sentence｜><｜User｜>Count<｜Assistant｜></think>1, 2,"),
    ("glm-4.7", "sys_user"): ("[gMASK]<sop><|system|>Be brief.<|user|>Hi<|assistant|><think>"),
    ("glm-4.7", "think_on"): ("[gMASK]<sop><|system|>Be brief.<|user|>Hi<|assistant|><think>"),
    ("glm-4.7", "think_off"): ("[gMASK]<sop><|system|>Be brief.<|user|>Hi<|assistant|></think>"),
    ("glm-4.7", "tools"): (
        "[gMASK]<sop><|system|>\n"
        "# Tools\n"
        "\n"
        "You may call one or more functions to assist with the user query.\n"
        "\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        "<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "Get the weather", "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string", "description": "The city"}, "unit": {"type": "string", "enum": ["c", "f"]}}}}}\n'
        "</tools>\n"
        "\n"
        "For each function call, output the function name and arguments within the following XML format:\n"
        "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call><|system|>Be brief.<|user|>Hi<|assistant|><think>"
    ),
    ("glm-4.7", "call"): (
        "[gMASK]<sop><|system|>\n"
        "# Tools\n"
        "\n"
        "You may call one or more functions to assist with the user query.\n"
        "\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        "<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "Get the weather", "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string", "description": "The city"}, "unit": {"type": "string", "enum": ["c", "f"]}}}}}\n'
        "</tools>\n"
        "\n"
        "For each function call, output the function name and arguments within the following XML format:\n"
        "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call><|user|>Weather in Paris?<|assistant|><think>Need weather.</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call><|observation|><tool_response>18C</tool_response><|assistant|><think>"
    ),
    ("glm-4.7", "prefill"): ("[gMASK]<sop><|user|>Count<|assistant|></think>1, 2,"),
    ("glm-4.6", "sys_user"): ("[gMASK]<sop><|system|>\nBe brief.<|user|>\nHi<|assistant|>"),
    ("glm-4.6", "think_on"): ("[gMASK]<sop><|system|>\nBe brief.<|user|>\nHi<|assistant|>"),
    ("glm-4.6", "think_off"): ("[gMASK]<sop><|system|>\nBe brief.<|user|>\nHi/nothink<|assistant|>\n<think></think>\n"),
    ("glm-4.6", "tools"): (
        "[gMASK]<sop><|system|>\n"
        "# Tools\n"
        "\n"
        "You may call one or more functions to assist with the user query.\n"
        "\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        "<tools>\n"
        '{"type":"function","function":{"name":"get_weather","description":"Get the weather","parameters":{"type":"object","required":["city"],"properties":{"city":{"type":"string","description":"The city"},"unit":{"type":"string","enum":["c","f"]}}}}}\n'
        "</tools>\n"
        "\n"
        "For each function call, output the function name and arguments within the following XML format:\n"
        "<tool_call>{function-name}\n"
        "<arg_key>{arg-key-1}</arg_key>\n"
        "<arg_value>{arg-value-1}</arg_value>\n"
        "<arg_key>{arg-key-2}</arg_key>\n"
        "<arg_value>{arg-value-2}</arg_value>\n"
        "...\n"
        "</tool_call><|system|>\n"
        "Be brief.<|user|>\n"
        "Hi<|assistant|>"
    ),
    ("glm-4.6", "call"): (
        "[gMASK]<sop><|system|>\n"
        "# Tools\n"
        "\n"
        "You may call one or more functions to assist with the user query.\n"
        "\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        "<tools>\n"
        '{"type":"function","function":{"name":"get_weather","description":"Get the weather","parameters":{"type":"object","required":["city"],"properties":{"city":{"type":"string","description":"The city"},"unit":{"type":"string","enum":["c","f"]}}}}}\n'
        "</tools>\n"
        "\n"
        "For each function call, output the function name and arguments within the following XML format:\n"
        "<tool_call>{function-name}\n"
        "<arg_key>{arg-key-1}</arg_key>\n"
        "<arg_value>{arg-value-1}</arg_value>\n"
        "<arg_key>{arg-key-2}</arg_key>\n"
        "<arg_value>{arg-value-2}</arg_value>\n"
        "...\n"
        "</tool_call><|user|>\n"
        "Weather in Paris?<|assistant|>\n"
        "<think>Need weather.</think>\n"
        "<tool_call>get_weather\n"
        "<arg_key>city</arg_key>\n"
        "<arg_value>Paris</arg_value>\n"
        "</tool_call><|observation|>\n"
        "<tool_response>\n"
        "18C\n"
        "</tool_response><|assistant|>"
    ),
    ("glm-4.6", "prefill"): ("[gMASK]<sop><|user|>\nCount<|assistant|>\n<think></think>\n1, 2,"),
    ("gemma4", "sys_user"): ("<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"),
    ("gemma4", "think_on"): ("<bos><|turn>system\n<|think|>\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"),
    ("gemma4", "think_off"): ("<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"),
    ("gemma4", "tools"): (
        "<bos><|turn>system\n"
        'Be brief.<|tool>declaration:get_weather{description:<|"|>Get the weather<|"|>,parameters:{properties:{city:{description:<|"|>The city<|"|>,type:<|"|>STRING<|"|>},unit:{enum:[<|"|>c<|"|>,<|"|>f<|"|>],type:<|"|>STRING<|"|>}},required:[<|"|>city<|"|>],type:<|"|>OBJECT<|"|>}}<tool|><turn|>\n'
        "<|turn>user\n"
        "Hi<turn|>\n"
        "<|turn>model\n"
    ),
    ("gemma4", "call"): (
        "<bos><|turn>system\n"
        "<|think|>\n"
        '<|tool>declaration:get_weather{description:<|"|>Get the weather<|"|>,parameters:{properties:{city:{description:<|"|>The city<|"|>,type:<|"|>STRING<|"|>},unit:{enum:[<|"|>c<|"|>,<|"|>f<|"|>],type:<|"|>STRING<|"|>}},required:[<|"|>city<|"|>],type:<|"|>OBJECT<|"|>}}<tool|><turn|>\n'
        "<|turn>user\n"
        "Weather in Paris?<turn|>\n"
        "<|turn>model\n"
        "<|channel>thought\n"
        "Need weather.\n"
        '<channel|><|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_response>response:get_weather{value:<|"|>18C<|"|>}<tool_response|><|channel>thought\n'
    ),
    ("gemma4", "prefill"): ("<bos><|turn>user\nCount<turn|>\n<|turn>model\n1, 2,"),
    ("gemma4-large", "sys_user"): (
        "<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
    ),
    ("gemma4-large", "think_on"): (
        "<bos><|turn>system\n<|think|>\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"
    ),
    ("gemma4-large", "think_off"): (
        "<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
    ),
    ("gemma4-large", "tools"): (
        "<bos><|turn>system\n"
        'Be brief.<|tool>declaration:get_weather{description:<|"|>Get the weather<|"|>,parameters:{properties:{city:{description:<|"|>The city<|"|>,type:<|"|>STRING<|"|>},unit:{enum:[<|"|>c<|"|>,<|"|>f<|"|>],type:<|"|>STRING<|"|>}},required:[<|"|>city<|"|>],type:<|"|>OBJECT<|"|>}}<tool|><turn|>\n'
        "<|turn>user\n"
        "Hi<turn|>\n"
        "<|turn>model\n"
        "<|channel>thought\n"
        "<channel|>"
    ),
    ("gemma4-large", "call"): (
        "<bos><|turn>system\n"
        "<|think|>\n"
        '<|tool>declaration:get_weather{description:<|"|>Get the weather<|"|>,parameters:{properties:{city:{description:<|"|>The city<|"|>,type:<|"|>STRING<|"|>},unit:{enum:[<|"|>c<|"|>,<|"|>f<|"|>],type:<|"|>STRING<|"|>}},required:[<|"|>city<|"|>],type:<|"|>OBJECT<|"|>}}<tool|><turn|>\n'
        "<|turn>user\n"
        "Weather in Paris?<turn|>\n"
        "<|turn>model\n"
        "<|channel>thought\n"
        "Need weather.\n"
        '<channel|><|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_response>response:get_weather{value:<|"|>18C<|"|>}<tool_response|><|channel>thought\n'
    ),
    ("gemma4-large", "prefill"): ("<bos><|turn>user\nCount<turn|>\n<|turn>model\n1, 2,"),
    ("harmony", "sys_user"): (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        "Knowledge cutoff: 2024-06\n"
        "Current date: 2025-08-05\n"
        "\n"
        "Reasoning: medium\n"
        "\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|><|start|>developer<|message|># Instructions\n"
        "\n"
        "Be brief.<|end|><|start|>user<|message|>Hi<|end|><|start|>assistant"
    ),
    ("harmony", "think_on"): (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        "Knowledge cutoff: 2024-06\n"
        "Current date: 2025-08-05\n"
        "\n"
        "Reasoning: medium\n"
        "\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|><|start|>developer<|message|># Instructions\n"
        "\n"
        "Be brief.<|end|><|start|>user<|message|>Hi<|end|><|start|>assistant"
    ),
    ("harmony", "think_off"): (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        "Knowledge cutoff: 2024-06\n"
        "Current date: 2025-08-05\n"
        "\n"
        "Reasoning: medium\n"
        "\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|><|start|>developer<|message|># Instructions\n"
        "\n"
        "Be brief.<|end|><|start|>user<|message|>Hi<|end|><|start|>assistant"
    ),
    ("harmony", "tools"): (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        "Knowledge cutoff: 2024-06\n"
        "Current date: 2025-08-05\n"
        "\n"
        "Reasoning: medium\n"
        "\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
        "Calls to these tools must go to the commentary channel: 'functions'.<|end|><|start|>developer<|message|># Instructions\n"
        "\n"
        "Be brief.\n"
        "\n"
        "# Tools\n"
        "\n"
        "## functions\n"
        "\n"
        "namespace functions {\n"
        "\n"
        "// Get the weather\n"
        "type get_weather = (_: {\n"
        "// The city\n"
        "city: string,\n"
        'unit?: "c" | "f",\n'
        "}) => any;\n"
        "\n"
        "} // namespace functions<|end|><|start|>user<|message|>Hi<|end|><|start|>assistant"
    ),
    ("harmony", "call"): (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        "Knowledge cutoff: 2024-06\n"
        "Current date: 2025-08-05\n"
        "\n"
        "Reasoning: medium\n"
        "\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
        "Calls to these tools must go to the commentary channel: 'functions'.<|end|><|start|>developer<|message|># Tools\n"
        "\n"
        "## functions\n"
        "\n"
        "namespace functions {\n"
        "\n"
        "// Get the weather\n"
        "type get_weather = (_: {\n"
        "// The city\n"
        "city: string,\n"
        'unit?: "c" | "f",\n'
        "}) => any;\n"
        "\n"
        '} // namespace functions<|end|><|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>18C<|end|><|start|>assistant'
    ),
    ("harmony", "prefill"): (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        "Knowledge cutoff: 2024-06\n"
        "Current date: 2025-08-05\n"
        "\n"
        "Reasoning: medium\n"
        "\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|><|start|>user<|message|>Count<|end|><|start|>assistant<|channel|>final<|message|>1, 2,"
    ),
}


@pytest.fixture(autouse=True)
def _fixed_date(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harmony, "today", lambda: datetime.date(2025, 8, 5))


@pytest.mark.parametrize(("family", "case"), sorted(EXPECTED))
def test_family_renders_case(family: str, case: str) -> None:
    renderer = renderer_for(family)
    assert renderer is not None
    messages, tools, think = CASES[case]
    assert render(renderer, messages, tools, think) == EXPECTED[family, case]


def test_registered_names() -> None:
    for name in ("qwen3-coder", "qwen3.5", "qwen3-vl-instruct", "qwen3-vl-thinking", "deepseek3.1", "deepseek3"):
        assert name in names()
    for name in ("glm-4.7", "glm-4.6", "gemma4", "gemma4-small", "gemma4-large", "harmony"):
        assert name in names()


@pytest.mark.parametrize(
    "family",
    ["qwen3-coder", "qwen3.5", "qwen3-vl-instruct", "deepseek3.1", "glm-4.7", "glm-4.6", "gemma4", "harmony"],
)
def test_unknown_role_is_invalid(family: str) -> None:
    renderer = renderer_for(family)
    assert renderer is not None
    with pytest.raises(InvalidRequest, match="role 'wizard'"):
        render(renderer, [{"role": "wizard", "content": "x"}], None, None)


def test_renderers_are_deterministic() -> None:
    for name in names():
        renderer = renderer_for(name)
        assert renderer is not None
        assert render(renderer, CALL, [WEATHER], True) == render(renderer, CALL, [WEATHER], True)


def test_qwen3_coder_groups_tool_results_and_encodes_arguments() -> None:
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": "Calling both.",
            "tool_calls": [
                {"function": {"name": "a", "arguments": {"n": 1, "flag": True, "obj": {"k": "v"}, "s": "x y"}}},
                {"function": {"name": "b", "arguments": {}}},
            ],
        },
        {"role": "tool", "content": "one", "tool_name": "a"},
        {"role": "tool", "content": "two", "tool_name": "b"},
    ]
    renderer = renderer_for("qwen3-coder")
    assert renderer is not None
    assert render(renderer, messages, None, None) == (
        "<|im_start|>user\ngo<|im_end|>\n"
        "<|im_start|>assistant\nCalling both.\n\n"
        "<tool_call>\n<function=a>\n"
        "<parameter=n>\n1\n</parameter>\n"
        "<parameter=flag>\ntrue\n</parameter>\n"
        '<parameter=obj>\n{"k":"v"}\n</parameter>\n'
        "<parameter=s>\nx y\n</parameter>\n"
        "</function>\n</tool_call>\n"
        "<tool_call>\n<function=b>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\none\n</tool_response>\n<tool_response>\ntwo\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_qwen35_drops_thinking_of_earlier_queries() -> None:
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "thinking": "old thoughts"},
        {"role": "user", "content": "Q2"},
    ]
    renderer = renderer_for("qwen3.5")
    assert renderer is not None
    assert render(renderer, messages, None, None) == (
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )


def test_deepseek_joins_system_messages_and_strips_past_thinking() -> None:
    messages = [
        {"role": "system", "content": "One."},
        {"role": "system", "content": "Two."},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>hmm</think>A1"},
        {"role": "user", "content": "Q2"},
    ]
    renderer = renderer_for("deepseek3.1")
    assert renderer is not None
    assert render(renderer, messages, None, "high") == (
        "<｜begin▁of▁sentence｜>One.\n\nTwo.<｜User｜>Q1<｜Assistant｜></think>A1<｜end▁of▁sentence｜>"
        "<｜User｜>Q2<｜Assistant｜><think>"
    )


def test_gemma4_resolves_tool_names_by_call_id_and_continues_the_model_turn() -> None:
    messages = [
        {"role": "user", "content": "Both"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c1", "function": {"name": "ls", "arguments": {"path": "/", "all": True}}},
                {"id": "c2", "function": {"name": "cat", "arguments": {"n": 2.0}}},
            ],
        },
        {"role": "tool", "content": "two", "tool_call_id": "c2"},
        {"role": "tool", "content": "one", "tool_call_id": "c1"},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "Thanks"},
    ]
    renderer = renderer_for("gemma4")
    assert renderer is not None
    assert render(renderer, messages, None, None) == (
        "<bos><|turn>user\nBoth<turn|>\n<|turn>model\n"
        '<|tool_call>call:ls{all:true,path:<|"|>/<|"|>}<tool_call|>'
        "<|tool_call>call:cat{n:2}<tool_call|>"
        '<|tool_response>response:cat{value:<|"|>two<|"|>}<tool_response|>'
        '<|tool_response>response:ls{value:<|"|>one<|"|>}<tool_response|>'
        "Done.<turn|>\n<|turn>user\nThanks<turn|>\n<|turn>model\n"
    )


def test_harmony_reasoning_levels_and_injected_clock() -> None:
    renderer = harmony.HarmonyRenderer(clock=lambda: datetime.date(2026, 1, 2))
    chat = [{"role": "user", "content": "Hi"}]
    assert render(renderer, chat, None, "high") == (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        "Knowledge cutoff: 2024-06\nCurrent date: 2026-01-02\n\nReasoning: high\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
        "<|start|>user<|message|>Hi<|end|><|start|>assistant"
    )
    assert "Reasoning: low\n" in render(renderer, chat, None, "low")
    assert "Reasoning: medium\n" in render(renderer, chat, None, False)


def test_harmony_tool_listing_types_and_parameterless_tools() -> None:
    tools = [
        {"type": "function", "function": {"name": "now", "description": "The time"}},
        {
            "type": "function",
            "function": {
                "name": "find",
                "parameters": {
                    "type": "object",
                    "required": ["q"],
                    "properties": {
                        "q": {"type": "string"},
                        "limit": {"type": "integer", "default": 10},
                        "tags": {"type": "array", "items": {"type": "string"}},
                        "exact": {"type": ["boolean", "null"]},
                    },
                },
            },
        },
    ]
    renderer = renderer_for("harmony")
    assert renderer is not None
    out = render(renderer, [{"role": "user", "content": "x"}], tools, None)
    assert (
        "<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n\n"
        "// The time\ntype now = () => any;\n\n"
        "type find = (_: {\nq: string,\nlimit?: number, // default: 10\ntags?: string[],\nexact?: boolean | null,\n"
        "}) => any;\n\n} // namespace functions<|end|>"
    ) in out
