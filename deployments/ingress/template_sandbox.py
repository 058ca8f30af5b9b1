"""Request-supplied chat templates, rendered in a process that can be killed.

Only with ``ingress.trust_request_chat_template`` does a request's own ``chat_template``
render at all (off by default, as vLLM's ``--trust-request-chat-template``). Even trusted, a
template is a program: Jinja's sandbox stops attribute tricks, not loops nested a thousand
deep or ``'x' * 10**10``, and neither stops in a thread once started. So it renders here: a
child process (``python -m deployments.ingress.template_sandbox``) with an address-space bound
(``resource.RLIMIT_AS``), one job at a time, each within the request's time budget. A job
that passes its budget kills the child (the next job starts a new one); a job over the memory
bound fails inside the child and the child lives on. Rendering is HF's own
(``transformers.utils.chat_template_utils.render_jinja_template``: the same sandboxed
environment, filters and globals ``apply_chat_template`` uses), with the model's special
tokens passed as template variables, as ``apply_chat_template`` passes them.

The wire is one JSON line per job each way: ``{"template", "messages", "tools", "documents",
"add_generation_prompt", "continue_final_message", "kwargs", "max_chars"}`` in, ``{"text"}``
or ``{"error"}`` out.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

#: address space the child may grow by past what it holds after its imports (bytes)
MEMORY_BOUND = 512 * 1024 * 1024
#: longest wait for a new child to be ready (its imports)
START_TIMEOUT_S = 60.0
#: longest line the parent reads back (a rendered prompt is bounded by ``max_chars`` anyway)
_READ_LIMIT = 64 * 1024 * 1024


class SandboxTimeout(TimeoutError):
    """The render passed its budget; the child was killed."""


class SandboxBusy(TimeoutError):
    """The budget passed while earlier jobs still held the child."""


class TemplateSandbox:
    """The parent's side: :meth:`render` sends one job to the child (started on first use)
    and waits for its answer at most ``timeout_s``. One job at a time."""

    def __init__(self) -> None:
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        #: held while a child starts: a job waits for a start outside its budget (the
        #: ingress's start-up start held the job lock once, and a first job on a loaded
        #: machine then found the sandbox "busy")
        self._starting = asyncio.Lock()
        #: the event loop the child's pipes belong to (a new loop starts a new child)
        self._loop: asyncio.AbstractEventLoop | None = None
        #: children started, killed for their time, jobs failed inside the child
        self.started = 0
        self.killed = 0
        self.failed = 0

    async def _child(self) -> asyncio.subprocess.Process:
        """The child, started now if there is none (and waited for until it has imported
        what it renders with: a start is not part of any job's budget)."""
        async with self._starting:
            return await self._start_child()

    async def _start_child(self) -> asyncio.subprocess.Process:
        if self._proc is None or self._proc.returncode is not None:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "deployments.ingress.template_sandbox",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
                limit=_READ_LIMIT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
            assert proc.stdout is not None
            ready = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)
            if ready.strip() != b"ready":
                proc.kill()
                raise ValueError("the template sandbox did not start")
            self._proc = proc
            self.started += 1
        return self._proc

    async def start(self) -> None:
        """Start the child ahead of the first job (the ingress does at start-up)."""
        if self._loop is not asyncio.get_running_loop():
            self.kill()
            self._lock, self._starting = asyncio.Lock(), asyncio.Lock()
            self._loop = asyncio.get_running_loop()
        await self._child()

    async def render(self, job: dict[str, Any], timeout_s: float) -> str:
        """The rendered text of ``job`` (see the module docstring); ``ValueError`` when the
        template failed (its message), :class:`SandboxTimeout` past ``timeout_s``,
        :class:`SandboxBusy` when the budget passed waiting for earlier jobs."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # pipes and locks belong to one loop
            self.kill()
            self._lock, self._starting = asyncio.Lock(), asyncio.Lock()
            self._loop = loop
        t0 = loop.time()
        try:
            await asyncio.wait_for(self._lock.acquire(), timeout_s)
        except TimeoutError:
            raise SandboxBusy("the template sandbox is busy") from None
        try:
            left = timeout_s - (loop.time() - t0)  # the wait for earlier jobs is in the budget
            # not in the budget: the child's start is ours, not the job's (a replacement for a
            # killed child, on a loaded machine, took longer than a 1 s budget)
            await self._child()
            if left <= 0:
                raise SandboxBusy("the template sandbox is busy")
            try:
                return await asyncio.wait_for(self._roundtrip(job), left)
            except TimeoutError:
                self.kill()
                self.killed += 1
                raise SandboxTimeout(f"rendering took longer than {timeout_s:g} s") from None
        finally:
            self._lock.release()

    async def _roundtrip(self, job: dict[str, Any]) -> str:
        proc = await self._child()
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(job).encode() + b"\n")
        await proc.stdin.drain()
        line = await proc.stdout.readline()
        if not line:  # the child died (its memory bound hit outside the render, say)
            self.kill()
            self.failed += 1
            raise ValueError("the template sandbox ended while rendering")
        out = json.loads(line)
        if "error" in out:
            self.failed += 1
            raise ValueError(str(out["error"]))
        return str(out["text"])

    def kill(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()
        self._proc = None

    def stats(self) -> dict[str, int]:
        return {"started": self.started, "killed": self.killed, "failed": self.failed}


def _render(job: dict[str, Any]) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    # it returns (texts, generation indices), whatever its annotation says
    out: Any = render_jinja_template(
        conversations=[job["messages"]],
        chat_template=job["template"],
        tools=job.get("tools"),
        documents=job.get("documents"),
        add_generation_prompt=bool(job.get("add_generation_prompt")),
        continue_final_message=bool(job.get("continue_final_message")),
        **(job.get("kwargs") or {}),
    )
    text = str(out[0][0])
    if len(text) > int(job.get("max_chars") or sys.maxsize):
        raise ValueError(f"the rendered prompt has {len(text)} characters, above the bound")
    return text


def _bound_memory() -> None:
    try:
        import resource

        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[0])
        now = pages * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (now + MEMORY_BOUND, now + MEMORY_BOUND))
    except (OSError, ValueError, ImportError):  # not Linux: the time budget still holds
        pass


def main() -> None:
    """The child: render jobs from stdin until it closes."""
    from transformers.utils import chat_template_utils  # noqa: F401 - imported before the bound

    _bound_memory()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for line in sys.stdin:
        try:
            out: dict[str, Any] = {"text": _render(json.loads(line))}
        except MemoryError:
            out = {"error": "the template needed more memory than the sandbox allows"}
        except Exception as e:  # noqa: BLE001 - the template's own error, sent back
            out = {"error": f"{type(e).__name__}: {e}"[:500]}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
