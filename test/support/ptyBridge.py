"""Runs a command on a pseudo-terminal and bridges it to pipes, for tests that drive a program
as a person at a terminal would: this process's stdin goes to the terminal (keys: Ctrl-C is
b"\\x03", Ctrl-D b"\\x04", Enter b"\\r"), what the program writes to the terminal comes out on
this process's stdout, raw (escape sequences included). Exits with the program's exit code
(128 + N when a signal N ended it). SIGTERM to this bridge is passed on to the program.

    python3 ptyBridge.py COLUMNS ROWS COMMAND [ARGS...]
"""
import fcntl
import os
import pty
import select
import signal
import struct
import sys
import termios

columns, rows, argv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
pid, fd = pty.fork()
if pid == 0:
    fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    os.execvp(argv[0], argv)

signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGTERM))
inputs = [fd, 0]
while True:
    try:
        ready, _, _ = select.select(inputs, [], [])
    except InterruptedError:
        continue
    if fd in ready:
        try:
            data = os.read(fd, 65536)
        except OSError:
            data = b""
        if not data:
            break
        os.write(1, data)
    if 0 in ready:
        data = os.read(0, 65536)
        if data:
            os.write(fd, data)
        else:
            inputs = [fd]
_, status = os.waitpid(pid, 0)
sys.exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
