"""The harness of the kernel benchmarks (benchmarks/kernels/bench_<op>.py): the model's widths, the command line,
and one table of per-call times a case.

Each benchmark times implementations of one op side by side at the token counts around the op's thresholds in
qwen4exp/ops/tuning.py: the op as the model calls it (its dispatch), the implementations on either side of each
threshold, and the torch reference (compiled where the model compiles it). Every variant's output is compared with
the case's first variant (max |difference|). Steps the engine runs as CUDA graphs are timed inside one; operands
are cycled out of L2 (qwen4exp.bench.timing).

`--tiny` runs a benchmark at the `tiny` preset's widths in fp32 on the CPU, Triton kernels in its interpreter: it
checks the benchmark itself (arguments, shapes, agreement of the variants), not speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import weakref
from collections.abc import Callable

import torch

from .timing import Rotation, copies_out_of_l2, in_graph, max_abs_diff, time_per_call_us

# the widths the benchmarks run at: the released model's (with 128 experts and a 2M n-gram base)
PRESET = "flash-next-128e"
TINY_PRESET = "tiny"
# token counts above this are left out with --tiny (the interpreter runs every program of a grid in Python)
TINY_MAX_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class Widths:
    """The widths of one model, named as the benchmarks use them."""

    hidden: int
    layers: int
    gdn_layers: int
    attention_layers: int
    eps: float
    # hyper-connections
    hc: int
    hc_rank: int
    # routed and shared experts
    experts: int
    top_k: int
    moe_inter: int
    shared_inter: int
    # Gated DeltaNet
    gdn_key_heads: int
    gdn_value_heads: int
    gdn_key_dim: int
    gdn_value_dim: int
    conv_kernel: int
    # attention and the QSA indexer
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    index_heads: int
    index_kv_heads: int
    index_dim: int
    index_budget: int
    compress_ratio: int
    # PLE n-gram table
    ple_layers: int
    ngram_heads: int
    ple_dim: int
    ngram_base: int
    vocab: int

    @property
    def conv_dim(self) -> int:
        """GDN's q, k, v channels (the causal conv's width)."""
        return 2 * self.gdn_key_heads * self.gdn_key_dim + self.gdn_value_heads * self.gdn_value_dim

    @property
    def gdn_value_width(self) -> int:
        return self.gdn_value_heads * self.gdn_value_dim

    @property
    def attention_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def ngram_dim(self) -> int:
        """One n-gram head's row width."""
        return self.ple_dim // self.ngram_heads

    @property
    def ngram_rows(self) -> int:
        """Rows of one PLE layer's table (about: each head's table is a prime >= the base)."""
        return self.ngram_base * self.ngram_heads

    def projections(self) -> list[tuple[str, int, int, int]]:
        """(name, rows, columns, calls a decode step) of the bias-free projections the model runs through
        ops.linear: merged weights as the model lays them out (MergedLinear's ROW_ALIGN padding included)."""
        from ..model.merged_linear import ROW_ALIGN

        def padded(n):
            return n + (-n) % ROW_ALIGN

        attention_rows = (2 * self.attention_width + 2 * self.kv_heads * self.head_dim
                          + (self.index_heads + self.index_kv_heads) * self.index_dim)
        return [
            ("out_proj / o_proj", self.hidden, self.gdn_value_width, self.layers),
            ("router + shared expert", padded(self.experts + 1 + 2 * self.shared_inter), self.hidden, self.layers),
            ("GDN in_proj", padded(self.conv_dim + self.gdn_value_width + 2 * self.gdn_value_heads), self.hidden,
             self.gdn_layers),
            ("attention q/k/v + indexer", padded(attention_rows), self.hidden, self.attention_layers),
        ]


def widths(preset: str) -> Widths:
    from ..weights.random_checkpoint import preset_config

    c = preset_config(preset)
    linear = c["layer_types"].count("linear_attention")
    rope = c["rope_parameters"]
    return Widths(
        hidden=c["hidden_size"], layers=c["num_hidden_layers"], gdn_layers=linear,
        attention_layers=c["num_hidden_layers"] - linear, eps=c["rms_norm_eps"],
        hc=c["hc_count"], hc_rank=c["hc_lowrank"],
        experts=c["num_experts"], top_k=c["num_experts_per_tok"], moe_inter=c["moe_intermediate_size"],
        shared_inter=c["shared_expert_intermediate_size"],
        gdn_key_heads=c["linear_num_key_heads"], gdn_value_heads=c["linear_num_value_heads"],
        gdn_key_dim=c["linear_key_head_dim"], gdn_value_dim=c["linear_value_head_dim"],
        conv_kernel=c["linear_conv_kernel_dim"],
        heads=c["num_attention_heads"], kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
        rotary_dim=int(c["head_dim"] * rope.get("partial_rotary_factor", 1.0)),
        index_heads=c["indexer_n_heads"], index_kv_heads=c["indexer_kv_heads"], index_dim=c["indexer_head_dim"],
        index_budget=c["indexer_budget"], compress_ratio=c["indexer_compress_ratio"],
        ple_layers=len(c["ple_layer_ids"]), ngram_heads=(c["ngram_size"] - 1) * c["heads_per_ngram"],
        ple_dim=c["ple_embed_dim"], ngram_base=c["ngram_vocab_size_base"], vocab=c["vocab_size"])


@dataclasses.dataclass
class Variant:
    """One implementation in a case: `fn()` runs one call. `graph`: whether it may be captured in a CUDA graph (a
    torch reference that reads values on the host may not); it then runs eagerly even where the engine would
    replay a graph. `once`: timed over a single call."""

    name: str
    fn: Callable[[], object]
    graph: bool = True
    # a reference too slow to repeat at this size: timed over one call
    once: bool = False


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default=None, help="comma-separated token counts instead of the benchmark's own")
    p.add_argument("--reps", type=int, default=30, help="timed rounds of each variant (median reported)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--preset", default=PRESET,
                   help="the model whose widths the benchmark runs at (thresholds in ops/tuning.py were measured at "
                        f"{PRESET}'s)")
    p.add_argument("--tiny", action="store_true",
                   help="the tiny preset's widths in fp32 on the CPU, Triton kernels in the interpreter: checks "
                        "the benchmark, not speed")
    return p


class Bench:
    """One benchmark run: the device, widths and options, and the rows measured so far."""

    def __init__(self, args: argparse.Namespace, name: str):
        self.name = name
        self.args = args
        self.tiny = args.tiny
        self.device = torch.device("cpu" if args.tiny else "cuda")
        # the model's bf16 on the GPU; fp32 in the interpreter, which has no bf16 tl.dot
        self.dtype = torch.float32 if args.tiny else torch.bfloat16
        self.widths = widths(TINY_PRESET if args.tiny else args.preset)
        self.reps = 1 if args.tiny else args.reps
        self.json_path = args.json
        self._tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else None
        self.generator = torch.Generator(self.device).manual_seed(0)
        self.rows: list[dict] = []
        # weakly: a rotation's copies are freed once the benchmark's closures over it are
        self._rotations: weakref.WeakSet[Rotation] = weakref.WeakSet()

    # ---- inputs ----

    def tokens(self, default) -> list[int]:
        """The token counts to measure: --tokens, else `default` (without the large ones under --tiny)."""
        if self._tokens:
            return self._tokens
        counts = sorted(set(default))
        return ([t for t in counts if t <= TINY_MAX_TOKENS] or counts[:1]) if self.tiny else counts

    def randn(self, *shape, scale: float = 1.0, dtype=None) -> torch.Tensor:
        x = torch.randn(*shape, device=self.device, generator=self.generator)
        return (x * scale).to(dtype or self.dtype)

    def weight(self, rows: int, cols: int) -> torch.Tensor:
        """A random [rows, cols] weight scaled like an initialised one (unit-variance outputs)."""
        return self.randn(rows, cols, scale=cols ** -0.5)

    def copies(self, make: Callable[[], object], nbytes: int, calls: int) -> list:
        """Enough results of `make()` (operands of `nbytes`) that calls cycling through them never find theirs in
        L2 (one under --tiny)."""
        n = 1 if self.tiny else copies_out_of_l2(nbytes, calls)
        return [make() for _ in range(n)]

    def rotation(self, items: list) -> Rotation:
        """A Rotation over `items` that `measure` rewinds before each variant's first call, so that every variant's
        compared output comes from the same operands."""
        r = Rotation(items)
        self._rotations.add(r)
        return r

    def model_config(self):
        """The ModelConfig of the widths' preset (for step metadata)."""
        if not hasattr(self, "_model_config"):
            from .engines import preset_model_config

            self._model_config = preset_model_config(TINY_PRESET if self.tiny else self.args.preset)
        return self._model_config

    def step(self, requests: list[tuple[int, int]], page_size: int = 16, graph: bool = False):
        """Step metadata for requests of (new tokens, tokens already cached), decodes first, with pages shuffled
        over the cache: (metadata, number of pages). `graph`: the step runs in a CUDA graph (ops take their
        graph-safe paths)."""
        from ..engine.step_builder import RequestChunk, StepBuilder

        pages_each = [-(-(new + cached) // page_size) for new, cached in requests]
        order = torch.randperm(sum(pages_each), generator=torch.Generator().manual_seed(0)) + 1  # page 0: padding
        chunks, start = [], 0
        for r, ((new, cached), n) in enumerate(zip(requests, pages_each)):
            pages = order[start:start + n].tolist()
            start += n
            chunks.append(RequestChunk([1] * new, cached, [1] * cached, pages, r + 1, new - 1))
        meta = StepBuilder(self.model_config(), page_size).build(chunks).to_metadata(self.device)
        meta.in_cuda_graph = graph
        return meta, sum(pages_each) + 1

    # ---- measuring ----

    def measure(self, case: str, tokens: int, variants: list[Variant], calls: int, graph: bool | None = None,
                compare: Callable | None = None, **info) -> dict:
        """Times every variant (`calls` calls a round; inside a CUDA graph when the engine runs a step of `tokens`
        tokens as one, unless `graph` says otherwise) and compares its output with the first variant's, through
        `compare(output)` when given (e.g. a canonical order). Returns and records the row: case, tokens,
        `<variant>_us`, `<variant>_diff`, and `info`."""
        graph = in_graph(tokens) if graph is None else graph
        calls = 1 if self.tiny else calls
        row = {"case": case, "tokens": tokens, "graph": graph, **info}
        first = None
        for v in variants:
            for r in self._rotations:
                r.rewind()
            out = v.fn()
            if compare is not None and out is not None:
                out = compare(out)
            if first is None:
                first = out
            row[f"{v.name}_diff"] = max_abs_diff(out, first) if out is not None else None
            # the call above was the warm-up
            row[f"{v.name}_us"] = time_per_call_us(v.fn, 1 if v.once else calls, graph=graph and v.graph,
                                                   reps=1 if v.once else self.reps, device=self.device,
                                                   warm_up=False)
        self.rows.append(row)
        return row

    # ---- output ----

    def table(self, case: str) -> str:
        """The rows of `case` as a text table: one row per token count, one column per variant (us a call, and the
        max |difference| from the first variant)."""
        rows = [r for r in self.rows if r["case"] == case]
        names = list(dict.fromkeys(k[:-3] for r in rows for k in r if k.endswith("_us")))
        header = ["tokens", "graph"] + names
        body = [[str(r["tokens"]), "yes" if r["graph"] else "no"]
                + [_cell(r.get(f"{n}_us"), r.get(f"{n}_diff"), i == 0) for i, n in enumerate(names)] for r in rows]
        width = [max(len(x) for x in col) for col in zip(header, *body)]
        lines = [case, "  ".join(h.rjust(w) for h, w in zip(header, width))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(line, width)) for line in body]
        return "\n".join(lines)

    def report(self) -> None:
        """Prints every case's table (us a call; in brackets the max |difference| from the case's first column)
        and writes the JSON."""
        for case in dict.fromkeys(r["case"] for r in self.rows):
            print(self.table(case), end="\n\n", flush=True)
        if self.json_path:
            with open(self.json_path, "w") as f:
                json.dump({"benchmark": self.name, "device": _device_name(self.device),
                           "widths": dataclasses.asdict(self.widths), "rows": self.rows}, f, indent=1)
                f.write("\n")


def _cell(us, diff, first: bool) -> str:
    if us is None:
        return "-"
    text = f"{us:.2f}"
    if not first and diff is not None:
        text += f" ({diff:.2g})"
    return text


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"


def run(main: Callable[[Bench], None], description: str, name: str, argv: list[str] | None = None,
        arguments: Callable[[argparse.ArgumentParser], None] | None = None) -> Bench:
    """Parses the command line (the common options, and the benchmark's own from `arguments(parser)`, found in
    `bench.args`), runs `main(bench)` (with the fast paths on the CPU under --tiny) and reports."""
    from .. import ops

    p = parser(description)
    if arguments is not None:
        arguments(p)
    args = p.parse_args(argv)
    bench = Bench(args, name)
    with ops.settings.override(fast_on_cpu=bench.tiny):
        main(bench)
    bench.report()
    return bench


def with_tuning(fn: Callable[[], object], **values) -> Callable[[], object]:
    """`fn` run with thresholds of qwen4exp.ops.tuning set to `values` (e.g. PAIRWISE_MAX_PAIRS=0): the op as the
    model would run it were the threshold there. The dispatch reads them at each call, so a CUDA graph captured
    this way keeps the kernels they chose."""
    from ..ops import tuning

    for name in values:
        if not hasattr(tuning, name):
            raise AttributeError(f"qwen4exp.ops.tuning has no {name}")

    def call():
        saved = {name: getattr(tuning, name) for name in values}
        for name, value in values.items():
            setattr(tuning, name, value)
        try:
            return fn()
        finally:
            for name, value in saved.items():
                setattr(tuning, name, value)
    return call


def reference(fn: Callable[[], object]) -> Callable[[], object]:
    """`fn` run with every op on its torch reference (ops.settings.reference), as on the CPU; compiled functions run
    eagerly then. For references the model compiles on the GPU, call the compiled function itself instead."""
    from .. import ops

    def call():
        with ops.settings.override(reference=True):
            return fn()
    return call


# a threshold no step reaches
NEVER = 1 << 62


def around(threshold: int, per: int = 1) -> list[int]:
    """Token counts around a threshold of `threshold` units of `per` units a token (e.g. pairs at top-k): the last
    token count at or under it, the first over it, and half and twice it."""
    last = max(1, threshold // per)
    return sorted({max(1, last // 2), last, last + 1, 2 * last})

