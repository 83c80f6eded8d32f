"""Automatic prefix caching, as integers: pages named by the hash chain of their tokens, shared between requests by
reference counts, least recently used eviction of the unreferenced ones, and state checkpoints.

A full page's key is sha256(parent page's key, its token ids, its extra keys), so one key names the whole prefix up
to the page's end; `extra_keys` is where anything else that changes a page's content (an image's hash) joins the
chain. The first page's parent comes from the prompt's `cache_salt` (`salt_key`), which so renames all its pages.
A page gets its key when a checkpoint after it is saved (requests scheduled from the next step on find it), and
keeps it (and stays findable) after the requests that hold it finish, until it is evicted for a new page.

The hybrid model's GDN recurrent and conv states and PLE conv windows cannot be rebuilt from the pages (QSA's raw
and compressed indexer keys live in the pages, a block never straddling one, and the n-gram context comes from the
tokens). A request can therefore resume only at a page boundary for which a checkpoint holds that state: a state
slot beyond the running sequences' slots, keyed like the page that ends at the boundary and freed when that page is
evicted (or, when every checkpoint slot is taken, the least recently used checkpoint is dropped).

Checkpoints are taken, as vLLM's "align" mode does, where a prefill chunk ends on a page boundary chosen for it:
- a prompt's last page boundary: the next turn of a conversation (whose prompt extends this one) resumes there. A
  prompt that fills its last page is checkpointed at its end, after its final chunk, costing no extra step (an
  identical prompt, which must compute its last token, cannot resume there: the next rule gives the third copy a
  checkpoint one page earlier); any other prompt's chunk is cut at the boundary, one more step when it prefills
  alone (an 8k prompt's TTFT on flash-next-128e: about 25 ms, the weights read once more);
- the end of the cached pages a prompt matched beyond its usable checkpoint: a prefix two prompts share (a system
  prompt) gets a checkpoint the second time it is computed, so the third and later prompts resume there.
So a prompt costs at most two checkpoints and two extra chunk boundaries, and decode steps are left as they were.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

ROOT_KEY = b""


def salt_key(salt: str | None) -> bytes:
    """The parent key of a prompt's first page: a salted prompt's pages (vLLM's `cache_salt`) are named apart from
    every prompt without that salt, so a client cannot learn from timing whether another's prompt was cached."""
    return ROOT_KEY if salt is None else hashlib.sha256(b"cache_salt\0" + salt.encode()).digest()


def page_keys(token_ids: list[int], page_size: int, num_pages: int, extra_keys: list[bytes] | None = None,
              parent: bytes = ROOT_KEY) -> list[bytes]:
    """The chained keys of the first `num_pages` full pages of `token_ids` (`extra_keys[i]`: more of page i's
    identity)."""
    keys = []
    for i in range(num_pages):
        h = hashlib.sha256(parent)
        h.update(array("q", token_ids[i * page_size:(i + 1) * page_size]).tobytes())
        if extra_keys is not None and extra_keys[i]:
            h.update(extra_keys[i])
        parent = h.digest()
        keys.append(parent)
    return keys


class PrefixCache:
    """The page allocator with shared, named pages, and the checkpoint slots.

    Pages: `allocate` hands out unreferenced pages (never-named ones first, then the least recently used named ones,
    which are forgotten), `share` takes a reference on named pages a request found, `free` drops references. A page
    whose last reference goes stays named and findable until allocated again, so `num_free` counts it."""

    def __init__(self, num_pages: int, checkpoint_slots: list[int]):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # never-named pages; id 0 is the null page
        self.refs = [0] * num_pages
        self.key_of: dict[int, bytes] = {}
        self.page_of: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced named pages, least recently used first
        self.checkpoints: OrderedDict[bytes, int] = OrderedDict()  # page key -> state slot, least recently used first
        self.checkpoint_slots = list(checkpoint_slots)
        self._free_checkpoint_slots = list(reversed(checkpoint_slots))
        self.num_evicted = 0  # named pages allocated again

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self.evictable)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"out of cache pages: want {n}, have {self.num_free}")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self.evictable.popitem(last=False)
                self._forget(page)
                self.num_evicted += 1
            self.refs[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: list[int]) -> None:
        # last page first: of one request's pages, the later ones are evicted before the earlier ones, which more
        # prompts share
        for page in reversed(pages):
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if page in self.key_of:
                    self.evictable[page] = None
                else:
                    self._free.append(page)

    def share(self, pages: list[int]) -> None:
        for page in pages:
            if self.refs[page] == 0:
                del self.evictable[page]
            self.refs[page] += 1

    def num_evictable(self, pages: list[int]) -> int:
        """Of `pages`, those that count as free now (unreferenced)."""
        return sum(self.refs[p] == 0 for p in pages)

    def _forget(self, page: int) -> None:
        key = self.key_of.pop(page)
        del self.page_of[key]
        slot = self.checkpoints.pop(key, None)
        if slot is not None:
            self._free_checkpoint_slots.append(slot)

    # ----- lookup and checkpoints -----
    def lookup(self, keys: list[bytes]) -> tuple[int, int]:
        """(matched, resumable): how many leading pages of `keys` are cached, and the most of them followed by a
        checkpoint (0: none)."""
        matched = resumable = 0
        for key in keys:
            if key not in self.page_of:
                break
            matched += 1
            if key in self.checkpoints:
                resumable = matched
        return matched, resumable

    def pages_of(self, keys: list[bytes]) -> list[int]:
        return [self.page_of[k] for k in keys]

    def checkpoint_of(self, key: bytes) -> int:
        """The slot holding the state at the end of the page named `key` (marked as just used)."""
        self.checkpoints.move_to_end(key)
        return self.checkpoints[key]

    def save(self, keys: list[bytes], pages: list[int]) -> int | None:
        """Names `pages` (computed, in order) by `keys` where their keys are new, and returns a checkpoint slot for
        the state at the end of the last one, which the caller fills (a free slot, else the least recently used
        checkpoint's); None where that checkpoint exists already."""
        for key, page in zip(keys, pages):
            if key not in self.page_of and page not in self.key_of:
                self.page_of[key] = page
                self.key_of[page] = key
        key = keys[-1]
        if key in self.checkpoints:
            self.checkpoints.move_to_end(key)
            return None
        if self._free_checkpoint_slots:
            slot = self._free_checkpoint_slots.pop()
        else:
            _, slot = self.checkpoints.popitem(last=False)
        self.checkpoints[key] = slot
        return slot

    def reset(self) -> bool:
        """Forgets every name and checkpoint; False (and nothing changed) while a page is referenced."""
        if len(self._free) + len(self.evictable) != self.num_usable:
            return False
        for page in list(self.evictable):
            self._forget(page)
            self._free.append(page)
        self.evictable.clear()
        assert not self.checkpoints and not self.page_of
        return True

    @property
    def num_checkpoints(self) -> int:
        return len(self.checkpoints)
