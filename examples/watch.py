"""Watch a directory in a box: the events of what a command does there, as it does it.
Usage: python examples/watch.py [ROOTFS]"""

from _rootfs import rootfs

import sandlot

with sandlot.Box(rootfs=rootfs(), memory_mib=256) as box:
    box.files.mkdir("/work")
    script = "echo 'print(1)' > /work/main.py && mv /work/main.py /work/app.py && rm /work/app.py"
    with box.files.watch("/work") as events:  # watching from here on
        box.spawn("sh", "-c", script)  # runs on in the box while we read its events
        for event in events:
            print(event.type, event.path, event.old_path or "")
            if event.type == "deleted":
                break  # leaving the loop closes the watch
# created /work/main.py
# modified /work/main.py
# moved /work/app.py /work/main.py
# deleted /work/app.py
