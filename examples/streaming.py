"""Stream a long-running command's output and talk to it on stdin.
Usage: python examples/streaming.py [ROOTFS]"""

from _rootfs import rootfs

import sandlot

with sandlot.Box(rootfs=rootfs(), memory_mib=256) as box:
    counter = box.spawn("sh", "-c", "for i in 1 2 3 4 5; do echo tick $i; sleep 0.2; done")
    for line in counter.stdout.lines():
        print("got", line.decode().strip())
    print("counter exited with", counter.wait())

    repl = box.spawn("sh", "-c", 'while read x; do echo "$((x * x))"; done')
    answers = repl.stdout.lines()
    for n in (3, 7, 12):
        repl.write_stdin(f"{n}\n")
        print(n, "squared is", next(answers).decode().strip())
    repl.close_stdin()
    repl.wait()

    shell = box.spawn("sh", tty=True, rows=40, cols=120)
    shell.write_stdin("stty size; exit\n")
    print("tty says:", b"".join(shell.stdout).decode().split("\r\n")[-2])
