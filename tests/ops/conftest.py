import torch


def on_device(fn):
    """Run a kernel on the GPU when there is one (tests build their inputs on the CPU): tensor arguments are copied
    to CUDA, and results and in-place updates are copied back. Without a GPU the kernel runs as is (interpreter)."""
    if not torch.cuda.is_available():
        return fn

    def to(x, dev):
        if isinstance(x, tuple):
            return tuple(to(t, dev) for t in x)
        return x.to(dev) if isinstance(x, torch.Tensor) else x

    def wrapped(*args, **kwargs):
        g_args = [to(a, "cuda") for a in args]
        g_kwargs = {k: to(v, "cuda") for k, v in kwargs.items()}
        out = fn(*g_args, **g_kwargs)
        for a, g in list(zip(args, g_args)) + [(kwargs[k], g_kwargs[k]) for k in kwargs]:
            if isinstance(a, torch.Tensor):
                a.copy_(g.cpu())
        if isinstance(out, tuple):
            return tuple(to(o, "cpu") for o in out)
        return to(out, "cpu")

    return wrapped
