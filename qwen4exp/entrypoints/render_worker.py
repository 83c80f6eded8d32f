"""A render worker process: renders chat templates and tokenizes for the server (see render_pool.py).

Run as `python -P render_worker.py FD`, a plain script: it imports neither torch nor qwen4exp, only what unpickling
the tokenizer needs. Over the connection on file descriptor FD it first receives the pickled tokenizer and answers
"ready", then answers each (op, args) message with ("ok", result) or ("error", message). The pool kills the process
when a job runs past its time limit, so nothing here has to stop itself; the process dies with its parent, and its
address space is capped so that a template cannot take the machine's memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import pickle
import resource
import signal
import sys
from multiprocessing.connection import Connection

# a job whose message or reply is larger than this leaves big freed blocks behind: they go back to the system
_TRIM_BYTES = 1 << 20
_MAX_ERROR_CHARS = 1000  # an error may quote its input (a template, a value)
_NICENESS = 10


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return None


def _die_with_parent(libc, parent_pid: int) -> None:
    pr_set_pdeathsig = 1
    if libc is not None and sys.platform.startswith("linux"):
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


def _cap_memory(extra_bytes: int) -> None:
    """Lets the address space grow by `extra_bytes` beyond what the loaded tokenizer uses: a template that builds a
    huge string gets a MemoryError (a 400) instead of the machine's memory."""
    if extra_bytes <= 0:
        return
    try:
        with open("/proc/self/status") as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration):
        return
    resource.setrlimit(resource.RLIMIT_AS, (size + extra_bytes, resource.RLIM_INFINITY))


class _TooLong(Exception):
    pass


def _trim(text: str, max_chars: int, side: str) -> str:
    """The part of `text` that truncation to at most max_chars / chars-per-token tokens can keep: no more than
    max_chars characters of the kept side."""
    if len(text) <= max_chars:
        return text
    return text[-max_chars:] if side == "left" else text[:max_chars]


def encode(tok, texts: list[str], add_special_tokens: bool, max_tokens: int,
           truncate: tuple[int, str] | None = None) -> list[list[int] | int]:
    """Token ids of each text, or for a text of more than `max_tokens` tokens only its token count (the server
    refuses it, so the ids would cross the pipe for nothing). With `truncate` = (k, side), the k last (side left) or
    first (right) ids of each text instead."""
    out = []
    for text in texts:
        ids = tok.encode(text, add_special_tokens=add_special_tokens)
        if truncate is not None:
            k, side = truncate
            out.append(ids if len(ids) <= k else ids[len(ids) - k:] if side == "left" else ids[:k])
        else:
            out.append(ids if len(ids) <= max_tokens else len(ids))
    return out


def render_chat(tok, conversation: list[dict], add_generation_prompt: bool, template: str | None, kwargs: dict,
                max_chars: int, max_tokens: int, tools: list[dict] | None = None, add_special_tokens: bool = False,
                truncate: tuple[int, str] | None = None, with_text: bool = False):
    """The chat template's token ids (or their count beyond `max_tokens`, as `encode`) for the conversation and
    `tools`, and with `with_text` its text too, as (ids, text). The rendered text is
    tokenized as apply_chat_template(tokenize=True) does, unless it is longer than `max_chars`, which no
    `max_tokens` tokens can hold: then it is refused, or with `truncate` cut to the max_chars characters of the kept
    side first."""
    text = tok.apply_chat_template(conversation, tools=tools, chat_template=template,
                                   add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs)
    if len(text) > max_chars and truncate is None:
        raise _TooLong(f"the chat template rendered {len(text)} characters, more than {max_chars} (the most that "
                       f"{max_tokens} tokens can hold)")
    source = text if truncate is None else _trim(text, max_chars, truncate[1])
    ids = encode(tok, [source], add_special_tokens, max_tokens, truncate)[0]
    return (ids, text) if with_text else ids


def decode(tok, ids: list[int]) -> str:
    return tok.decode(ids)


def token_strs(tok, ids: list[int]) -> list[str]:
    return tok.convert_ids_to_tokens(ids)


OPS = {"encode": encode, "render_chat": render_chat, "decode": decode, "token_strs": token_strs}


def main(fd: int, parent_pid: int, memory_cap: int) -> None:
    libc = _libc()
    _die_with_parent(libc, parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the server decides
    # where CPUs are short, the server's event loop and engine thread come first: they serve everyone
    os.nice(_NICENESS)
    conn = Connection(fd)
    tok = pickle.loads(conn.recv_bytes())
    _cap_memory(memory_cap)
    conn.send("ready")
    while True:
        try:
            message = conn.recv_bytes()
        except EOFError:  # the server closed the pool
            return
        op, args = pickle.loads(message)
        try:
            reply = ("ok", OPS[op](tok, *args))
        except MemoryError:
            reply = ("error", f"it needs more than the {memory_cap >> 20} MiB of memory a render worker may add")
        except Exception as e:  # noqa: BLE001 - template errors, clashing kwargs, bad ids: the request's fault
            text = str(e) if isinstance(e, _TooLong) else f"{type(e).__name__}: {e}"
            reply = ("error", text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS] + "...")
        data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        conn.send_bytes(data)
        trim = libc is not None and (max(len(message), len(data)) > _TRIM_BYTES or reply[0] == "error")
        del message, op, args, reply, data
        if trim:
            libc.malloc_trim(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
