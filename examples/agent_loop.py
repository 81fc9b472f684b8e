"""The agent loop of an LLM app, with sandlot's tools: the model is shown the tools'
schemas, asks for tool calls, sandlot runs them on real boxes, and the results go
back into the conversation until the model is done. Runs offline: a fixed script
stands in for the model (swap ``model`` for a call to yours: the messages and the
tool blocks are those of Anthropic's Messages API; ``tools.schemas("openai")`` and
``ToolResult.to_openai()`` are the OpenAI equivalents).

python examples/agent_loop.py [ROOTFS]

The script writes a program into a box and runs it, snapshots the box, breaks it,
rolls it back, makes a mistake in a tool call and corrects it from the error, and
forks the box to try two things at once.
"""

import os
import re
from typing import Any

from _rootfs import rootfs

import sandlot
from sandlot import tools

IMAGE = "examples/agent-busybox:1"
LABEL = {"example": "agent-loop"}
COUNT = """#!/bin/sh
mkdir -p /work && cd /work
printf 'pear\\napple\\npear\\nfig\\napple\\npear\\n' > fruit.txt
sort fruit.txt | uniq -c | sort -rn > report.txt
cat report.txt
"""

Message = dict[str, Any]


def model(messages: list[Message], tool_specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The model: the tool calls it makes next (``tool_use`` blocks), or none when it
    is done. Scripted here, reading the last results as a model would."""
    last = messages[-1]["content"] if messages[-1]["role"] == "user" else ""
    seen = " ".join(b["content"][0]["text"] for b in last if b["content"]) if isinstance(last, list) else ""
    box = f"agent-{os.getpid()}"
    script: list[list[tuple[str, dict[str, Any]]]] = [
        [("create_box", {"name": box, "memory_mib": 256})],
        [("write_file", {"box": box, "path": "/work/count.sh", "content": COUNT, "mode": "755"})],
        [("exec", {"box": box, "command": "/work/count.sh"})],
        [("snapshot", {"box": box, "name": "counted"})],
        [("exec", {"box": box, "command": "rm -rf /work; cat /work/report.txt"})],  # a step gone wrong
        [("rollback", {"box": box, "snapshot": "counted"})],
        [("read_file", {"box": box, "pth": "/work/report.txt"})],  # a typo: the error says what is wrong
        [("read_file", {"box": box, "path": "/work/report.txt"})],
        [("fork", {"box": box, "n": 2})],
    ]
    step = sum(1 for m in messages if m["role"] == "assistant")
    if step < len(script):
        calls = script[step]
    elif step == len(script):  # two ways to go on, one in each copy: names from fork's answer
        kids = re.findall(r"'(agent-[^']+-[0-9a-f]{6})'", seen)
        calls = [("exec", {"box": kids[0], "command": "head -n 1 /work/report.txt"}),
                 ("exec", {"box": kids[1], "command": "wc -l < /work/report.txt"})]  # fmt: skip
    elif step == len(script) + 1:
        calls = [("list_boxes", {})]
    elif step == len(script) + 2:
        calls = [("remove_box", {"box": name}) for name in re.findall(r"^(agent-\S+)", seen, re.M)]
    else:
        return []
    return [{"type": "tool_use", "id": f"toolu_{step}_{i}", "name": name, "input": args}
            for i, (name, args) in enumerate(calls)]  # fmt: skip


def main() -> None:
    sandlot.import_image(rootfs(), IMAGE)
    # the agent's boxes carry a label, and it sees only those: not the other boxes of the home
    kit = tools.Toolkit(image=IMAGE, limits=tools.Limits(max_boxes=3, max_memory_mib=512), labels=LABEL,
                        own_only=True)  # fmt: skip
    tool_specs = kit.schemas("anthropic")
    print(f"{len(tool_specs)} tools: {', '.join(t['name'] for t in tool_specs)}")
    task = "Count the fruit in a list and report the most common."
    messages: list[Message] = [{"role": "user", "content": task}]
    transcript: list[tuple[str, tools.ToolResult]] = []
    try:
        while calls := model(messages, tool_specs):
            messages.append({"role": "assistant", "content": calls})
            results = []
            for call in calls:
                result = tools.call(kit, call["name"], call["input"], raise_errors=False)
                transcript.append((call["name"], result))
                print(f"> {call['name']} {call['input']}\n{result.text}\n")
                results.append(result.to_anthropic(call["id"]))
            messages.append({"role": "user", "content": results})
    finally:
        for box in sandlot.list(labels=LABEL):  # whatever the script left behind
            box.remove(force=True)
    failed = [name for name, r in transcript if r.is_error]
    assert failed == ["read_file"], f"only the typo should have failed, not {failed}"
    report = next(r for name, r in transcript if name == "read_file" and not r.is_error).data["content"]
    assert report.split() == ["3", "pear", "2", "apple", "1", "fig"], report
    assert not sandlot.list(labels=LABEL)


if __name__ == "__main__":
    main()
