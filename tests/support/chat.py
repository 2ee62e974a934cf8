"""For the tests of `kdflow chat`: a chat template, and a child process on a real pseudo-terminal.

`Terminal` starts the child as the leader of a new session whose controlling terminal is the pty, so Ctrl-C
written to it (`\\x03`) is turned into SIGINT by the kernel's line discipline, as for a person at a terminal,
and `isatty()` is true in the child. Everything the child writes (and the terminal's echo) is collected by a
reader thread; `expect` waits for a piece of text. The child's whole process group is killed on close.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from support.children import kill_group, wait_until

# role: content lines, then the generation prompt: the history is visible in the rendered text.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")

# Runs in the child before kdflow: take the pty on stdin as the controlling terminal, then become the command.
_TAKE_TERMINAL = ("import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
                  "os.execvp(sys.argv[1], sys.argv[1:])")


def with_chat_template(model_dir: Path, target: Path, template: str = CHAT_TEMPLATE) -> Path:
    """A copy of a saved student whose tokenizer has `template`."""
    import shutil

    from transformers import AutoTokenizer

    shutil.copytree(model_dir, target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(target)
    return target


class Terminal:
    """`args` run on a pseudo-terminal (a context manager)."""

    def __init__(self, args: list[str], **popen: Any) -> None:
        master, slave = os.openpty()
        self.master, self._data, self._lock = master, bytearray(), threading.Lock()
        try:
            self.process = subprocess.Popen([sys.executable, "-c", _TAKE_TERMINAL, *args], stdin=slave, stdout=slave,
                                            stderr=slave, start_new_session=True, **popen)
        finally:
            os.close(slave)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 4096)
            except OSError:  # EIO: every process holding the terminal is gone
                return
            if not chunk:
                return
            with self._lock:
                self._data += chunk

    def output(self) -> str:
        with self._lock:
            return self._data.decode("utf-8", errors="replace")

    def send(self, text: str) -> None:
        """Type `text` (a line ends with \\r, as the Enter key sends)."""
        os.write(self.master, text.encode())

    def expect(self, text: str, *, after: int = 0, timeout: float = 300) -> int:
        """Wait until `text` appears in the output at or after character `after`; -> the index just past it."""
        wait_until(lambda: self.output().find(text, after) >= 0, what=f"{text!r} on the terminal", timeout=timeout,
                   process=self.process, output=self.output)
        return self.output().find(text, after) + len(text)

    def wait(self, timeout: float = 120) -> int:
        wait_until(lambda: self.process.poll() is not None, what="the end of the process", timeout=timeout,
                   output=self.output)
        return self.process.returncode

    def close(self) -> None:
        kill_group(self.process)
        try:
            self.process.wait(timeout=60)
        finally:
            self._reader.join(timeout=5)
            os.close(self.master)

    def __enter__(self) -> Terminal:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
