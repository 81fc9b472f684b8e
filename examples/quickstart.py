"""Boot a box, run commands, move files. Usage: python examples/quickstart.py [ROOTFS]"""

from _rootfs import rootfs

import sandlot

with sandlot.Box(rootfs=rootfs(), memory_mib=256) as box:
    print(f"booted {box.hostname} in {box.boot_seconds:.2f}s ({box.accel})")
    print(box.exec("uname", "-sr").stdout.strip())

    r = box.sh("echo to-stdout; echo to-stderr >&2; exit 3")
    print("exit", r.exit_code, "stdout", r.stdout.strip(), "stderr", r.stderr.strip())

    box.files.write("/home/agent/notes.txt", "remember this\n", user="agent")
    print(box.exec("cat", "/home/agent/notes.txt", user="agent").stdout.strip())
    for entry in box.files.list("/home/agent"):
        print(f"  {entry.name} {entry.size} bytes, mode {entry.mode:o}, uid {entry.uid}")

    try:
        box.exec("sleep", "60", timeout=1)
    except sandlot.ExecTimeout:
        print("sleep timed out and was killed; the box is still fine:", box.exec("echo", "ok").stdout.strip())
