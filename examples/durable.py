"""A box that outlives this script. Run it three times:

python examples/durable.py create [ROOTFS]  # makes and starts box "notebook", then exits
python examples/durable.py use      # another process finds it, and its files
python examples/durable.py remove
"""

import sys

from _rootfs import rootfs

import sandlot

step = sys.argv[1] if len(sys.argv) > 1 else "create"
if step == "create":
    box = sandlot.create(rootfs=rootfs(2), name="notebook", memory_mib=256, labels={"example": "durable"})
    box.start()
    box.files.write("/home/agent/todo.txt", "water the plants\n", user="agent")
    box.exec("sh", "-c", "(while true; do date >> /tmp/heartbeat; sleep 5; done) >/dev/null 2>&1 &")
    print(f"{box.name} is {box.state}; this process exits now")
elif step == "use":
    box = sandlot.get("notebook")
    print(box.state, box.stats())
    print("todo:", box.files.read_text("/home/agent/todo.txt").strip())
    print("heartbeats so far:", len(box.files.read_text("/tmp/heartbeat").splitlines()))
elif step == "remove":
    sandlot.get("notebook").remove(force=True)
    print("removed")
