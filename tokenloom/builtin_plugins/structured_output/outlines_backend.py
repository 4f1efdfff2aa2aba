"""The ``outlines`` guided-decoding backend, on outlines-core: every constraint becomes a regex
(JSON schemas through ``build_regex_from_schema``), indexed once over the vocabulary's token
bytes into an ``Index``; each sequence walks it with a ``Guide``. Regular languages only:
context-free grammars need the xgrammar backend.

Indexes are built in child processes (:mod:`.outlines_worker`), one per compile running at
once, kept for the next: building one takes exponential time for some regexes, and a child
past the compile time limit is killed, where a thread could only be abandoned."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from tokenloom.builtin_plugins.structured_output.common import (
    KEYWORDS_REGEX_BACKENDS_IGNORE,
    choice_regex,
    enumerate_integer_ranges,
    token_bytes,
    unsupported_keywords_reason,
)
from tokenloom.builtin_plugins.structured_output.outlines_worker import read_message, write_message
from tokenloom.core.structured_output import Matcher, StructuredOutputBackend
from tokenloom.core.structured_output_compile import compile_cancelled
from tokenloom.core.structured_output_constraints import Constraint

# idle index-building children kept for the next compiles (the compile pool runs two at once)
MAX_IDLE_WORKERS = 2
# how often a compile waiting on its child looks whether it overran its time limit
CANCEL_POLL_SECONDS = 0.05

# what build_regex_from_schema ignores (numeric bounds among them): outputs could break these
UNSUPPORTED_JSON_KEYWORDS = KEYWORDS_REGEX_BACKENDS_IGNORE


class OutlinesMatcher(Matcher):
    def __init__(self, index: Any, eos_token_ids: list[int], index_eos_token_id: int):
        from outlines_core import Guide

        self._guide = Guide(index)
        self._eos_token_ids = eos_token_ids
        self._index_eos_token_id = index_eos_token_id
        self._terminated = False

    def fill_bitmask(self, bitmask, row: int) -> None:
        words = bitmask[row]
        self._guide.write_mask_into(words.data_ptr(), words.numel(), words.element_size())
        eos = self._index_eos_token_id
        if (int(words[eos // 32]) >> (eos % 32)) & 1:
            # the index knows one end token: allow every end token the model has
            for token_id in self._eos_token_ids:
                words[token_id // 32] |= _bit(token_id % 32)

    def accept_token(self, token_id: int) -> bool:
        if token_id in self._eos_token_ids:
            if not self._guide.is_finished():
                return False
            self._terminated = True
            return True
        if not self._guide.accepts_tokens([token_id]):
            return False
        self._guide.advance(token_id, return_tokens=False)
        return True

    def is_terminated(self) -> bool:
        return self._terminated

    def reset(self) -> None:
        self._guide.reset()
        self._terminated = False


def _bit(position: int) -> int:
    # as a signed int32: bit 31 is the sign bit
    return (1 << position) - (1 << 32 if position == 31 else 0)


class IndexWorker:
    """One child process that builds indexes (:mod:`.outlines_worker`), given the vocabulary
    (pickled) once at its start."""

    def __init__(self, vocabulary_message: Any):
        package_root = str(Path(__file__).resolve().parents[3])  # the directory holding tokenloom/
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tokenloom.builtin_plugins.structured_output.outlines_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        assert self.process.stdin is not None and self.process.stdout is not None  # PIPE gives both
        self._requests = self.process.stdin
        self._replies = self.process.stdout
        write_message(self._requests, vocabulary_message)

    def build(self, job: tuple[str, str, str | None]) -> Any:
        """The index of ``job``; kills the child and raises TimeoutError as soon as the compile
        is cancelled (it overran the server's limit), ValueError for what outlines refused."""
        write_message(self._requests, job)
        while not select.select([self._replies], [], [], CANCEL_POLL_SECONDS)[0]:
            if compile_cancelled():
                self.kill()
                raise TimeoutError("the outlines index build overran the time limit and was stopped")
            if self.process.poll() is not None:
                raise RuntimeError(f"the outlines index builder exited with status {self.process.returncode}")
        try:
            status, value = read_message(self._replies)
        except EOFError:
            raise RuntimeError(f"the outlines index builder died (status {self.process.wait()})") from None
        if status != "ok":
            raise ValueError(value)
        return value

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def close(self) -> None:
        """Ends the child (it exits when its stdin closes)."""
        self._requests.close()
        self.process.wait()


class OutlinesBackend(StructuredOutputBackend):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._vocabulary = None
        self._lock = threading.Lock()
        self._idle_workers: list[IndexWorker] = []

    def supports(self, constraint: Constraint) -> str | None:
        if constraint.kind == "grammar":
            return "outlines (outlines-core) compiles regular languages only, not context-free grammars; use xgrammar"
        if constraint.kind == "structural_tag":
            return "outlines has no structural tags; use xgrammar"
        if constraint.kind == "json":
            return unsupported_keywords_reason(
                "outlines", enumerate_integer_ranges(constraint.spec), UNSUPPORTED_JSON_KEYWORDS
            )
        return None

    def vocabulary(self):
        with self._lock:
            if self._vocabulary is None:
                from outlines_core import Vocabulary

                tokens: dict[bytes, list[int]] = {}
                for token_id, text in enumerate(token_bytes(self.tokenizer, self.vocab_size)):
                    if text and token_id not in self.eos_token_ids:
                        tokens.setdefault(text, []).append(token_id)
                self._vocabulary = Vocabulary(self.eos_token_ids[0], tokens)
            return self._vocabulary

    def index_job(self, constraint: Constraint) -> tuple[str, str, str | None]:
        """What a child builds: ``("json", schema text, whitespace pattern)`` or ``("regex",
        regex, None)``."""
        if constraint.kind in ("json", "json_object"):
            schema = enumerate_integer_ranges(constraint.spec) if constraint.kind == "json" else {"type": "object"}
            whitespace = constraint.whitespace_pattern
            if whitespace is None and not constraint.any_whitespace:
                whitespace = ""
            return ("json", json.dumps(schema), whitespace)
        if constraint.kind == "choice":
            return ("regex", choice_regex(constraint.spec), None)
        return ("regex", constraint.spec, None)

    def regex(self, constraint: Constraint) -> str:
        from outlines_core.json_schema import build_regex_from_schema

        kind, text, whitespace = self.index_job(constraint)
        return build_regex_from_schema(text, whitespace) if kind == "json" else text

    def compile(self, constraint: Constraint) -> Any:
        job = self.index_job(constraint)
        vocabulary = self.vocabulary()
        with self._lock:
            worker = self._idle_workers.pop() if self._idle_workers else None
        if worker is None:
            worker = IndexWorker(vocabulary)
        try:
            return worker.build(job)
        except (TimeoutError, RuntimeError):
            worker.kill()  # stopped, or died: never reused
            worker = None
            raise
        finally:
            if worker is not None:
                self._release(worker)

    def _release(self, worker: IndexWorker) -> None:
        with self._lock:
            if len(self._idle_workers) < MAX_IDLE_WORKERS:
                self._idle_workers.append(worker)
                return
        worker.close()

    def new_matcher(self, compiled: Any) -> Matcher:
        return OutlinesMatcher(compiled, self.eos_token_ids, self.eos_token_ids[0])
