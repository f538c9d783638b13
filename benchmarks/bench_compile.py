#!/usr/bin/env python3
"""torch.compile and the AMP step: fusedamp against torch.amp, eager and compiled, side by side.

The same FP16 training step of the demo's character GPT, six ways:

  torch.amp eager      autocast(fp16) forward, torch.amp.GradScaler, torch.optim.AdamW(fused=True)
  torch.amp compiled   the same with the model compiled (torch.compile(model)) and the
                       optimizer step compiled as torch recommends (torch.compile(opt.step));
                       the scaler's step and update run eagerly around it
  fusedamp eager       fusedamp.initialize(model, AdamW, fp16): FP16 model, FP32 masters,
                       fusedamp.GradScaler
  fusedamp compiled    the same with the model and opt.step compiled the same way (the step
                       enters the graph as fusedamp's operator, fusedamp.compiled_step)

then both with the model compiled and the optimizer half (scaler.step(opt); scaler.update();
opt.zero_grad()) compiled as one function: fullgraph=True for fusedamp, with its graph breaks
for torch.amp (which cannot be one graph); then both with the whole step function (forward,
backward, scaler, optimizer) compiled with compiled autograd
(torch._dynamo.config.compiled_autograd), for the fewest graphs torch allows; and, for each
framework, the optimizer half compiled alone with fullgraph=True, to show whether it is one
graph. Per row:
the median step time after warm-up (and the ratio fusedamp / torch.amp of the same kind), the
compile time (the first call), and from torch._dynamo's counters the graphs compiled, the graph
breaks and the recompilations over the timed steps (which include a skipped step: an inf in the
loss scale's first steps, and a changing learning rate).

Like for like: both keep FP32 optimizer state for FP16 compute; torch.amp keeps FP32 weights and
casts them in autocast, fusedamp keeps FP16 weights with FP32 masters (a different layout, the
same algorithm, AdamW). On a CPU without FP16 arithmetic the forward and backward dominate;
the ratios say more than the times.

    PYTHONPATH=python python3 benchmarks/bench_compile.py [--steps 30] [--out benchmarks/results]
"""
from __future__ import annotations

import os
import statistics
import sys
import time

# The first call's time is the compile time only without inductor's on-disk caches (a run
# before this one would have filled them).
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import harness  # noqa: E402
from harness import results as res  # noqa: E402
from harness.machine import machine_info  # noqa: E402

harness.use_paths("python", "examples")
import fusedamp  # noqa: E402
from amp_models import CharGPT, char_batch, char_data  # noqa: E402

LR = 1e-3


def counters():
    """What torch._dynamo counted since the last reset: graphs, breaks, recompilations, and
    the backward graphs compiled autograd captured."""
    from torch._dynamo.utils import counters as c

    return {"graphs": int(c["stats"]["unique_graphs"]),
            "autograd_captures": int(c["compiled_autograd"]["captures"]),
            "graph_breaks": int(sum(c["graph_break"].values())),
            "break_reasons": sorted({r.strip().splitlines()[0][:120] for r in c["graph_break"]}),
            "recompiles": int(sum(c["recompiles"].values()))
            if "recompiles" in c else 0}


def reset_dynamo():
    import torch._dynamo
    from torch._dynamo.utils import counters as c

    torch._dynamo.reset()
    c.clear()


def build(framework, vocab, args):
    torch.manual_seed(0)
    model = CharGPT(vocab, context=args.context, dim=args.dim, layers=args.layers)
    if framework == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(LR), fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, growth_interval=5)
        return model, opt, scaler
    base = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt, scaler = fusedamp.initialize(model, base, torch.float16, init_scale=2.0 ** 24,
                                             growth_interval=5)
    opt.param_groups[0]["lr"] = torch.tensor(LR)  # a tensor lr, changed in place below
    return model, opt, scaler


MODES = ("eager", "compiled", "compiled, optimizer half as one graph", "compiled autograd")


def make_step(framework, model, opt, scaler, vocab, mode):
    """mode "compiled": the model and opt.step compiled apart (torch's recommendation);
    "compiled autograd": the whole step function compiled, backward included (compiled
    autograd, torch._dynamo.config.compiled_autograd), as few graphs as dynamo manages."""
    forward = torch.compile(model) if mode.startswith("compiled,") or mode == "compiled" else model
    if mode == "compiled":
        opt.step = torch.compile(opt.step)  # torch's recommended way to compile a step

    def optimizer_half():
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    if mode.startswith("compiled,"):
        # fusedamp's compiles with fullgraph=True; torch.amp's cannot (its scaler and
        # zero_grad are kept out of tracing), so it is compiled with its graph breaks.
        optimizer_half = torch.compile(optimizer_half, fullgraph=framework == "fusedamp")

    def step(x, y):
        if framework == "torch":
            with torch.autocast("cpu", dtype=torch.float16):
                logits = forward(x)
        else:
            logits = forward(x)
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1))
        scaler.scale(loss).backward()
        optimizer_half()
        return loss.detach()
    return torch.compile(step) if mode == "compiled autograd" else step


def run(framework, mode, data, vocab, args):
    reset_dynamo()
    model, opt, scaler = build(framework, vocab, args)
    # Set, not patched in a context: under config.patch torch 2.11's compiled frames did not
    # engage compiled autograd (no captures).
    torch._dynamo.config.compiled_autograd = mode == "compiled autograd"
    try:
        step = make_step(framework, model, opt, scaler, vocab, mode)
        out = timed_steps(framework, step, opt, data, args)
    finally:
        torch._dynamo.config.compiled_autograd = False
    out["mode"] = mode
    out.update(counters() if mode != "eager" else {})
    return out


def timed_steps(framework, step, opt, data, args):
    gen = torch.Generator().manual_seed(1)
    batches = [char_batch(data, args.batch, args.context, gen) for _ in range(args.steps + 3)]
    t0 = time.perf_counter()
    step(*batches[0])
    first = time.perf_counter() - t0
    for b in batches[1:3]:
        step(*b)
    times = []
    for i, b in enumerate(batches[3:]):
        opt.param_groups[0]["lr"].fill_(LR * (1 - i / (2 * args.steps)))  # a decaying lr
        t0 = time.perf_counter()
        step(*b)
        times.append(time.perf_counter() - t0)
    return {"framework": framework, "step_ms": 1e3 * statistics.median(times),
            "first_call_s": first,
            "skipped": int(getattr(opt, "skipped_steps", 0) or 0)
            if framework == "fusedamp" else None}


def optimizer_half_fullgraph(framework, data, vocab, args):
    """scaler.step(opt); scaler.update(); opt.zero_grad() under fullgraph=True: the first
    error's first line, or None where it compiled."""
    reset_dynamo()
    model, opt, scaler = build(framework, vocab, args)
    x, y = char_batch(data, args.batch, args.context, torch.Generator().manual_seed(2))
    ctx = torch.autocast("cpu", dtype=torch.float16) if framework == "torch" else None
    with ctx or torch.autocast("cpu", enabled=False):
        logits = model(x)
    loss = F.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1))
    scaler.scale(loss).backward()

    @torch.compile(fullgraph=True)
    def optimizer_half():
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    try:
        optimizer_half()
        return None
    except Exception as e:  # the graph break that fullgraph=True turns into an error
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"


def main(argv=None):
    ap = res.parser(__doc__.split("\n")[0])
    for name, default in (("steps", 30), ("batch", 8), ("context", 64), ("dim", 128),
                          ("layers", 2)):
        ap.add_argument(f"--{name}", type=int, default=default)
    res.add_output(ap)
    args = ap.parse_args(argv)
    data, _, vocab = char_data(torch.device("cpu"), context=args.context)
    info = machine_info("cpu")
    rows = [run(fw, mode, data, vocab, args) for mode in MODES for fw in ("torch", "fusedamp")]
    fullgraph = {fw: optimizer_half_fullgraph(fw, data, vocab, args)
                 for fw in ("torch", "fusedamp")}
    by = {(r["framework"], r["mode"]): r for r in rows}
    lines = ["# torch.compile and the AMP step (CPU)", "",
             f"`PYTHONPATH=python python3 benchmarks/bench_compile.py --steps {args.steps}`", "",
             f"{info['date_utc']}, fusedamp {info.get('fusedamp_commit', '?')}, {info['cpu']} "
             f"({info['cpu_cores']} cores, torch CPU capability {info['cpu_capability']}), "
             f"torch {info['torch']}. The demo's character GPT (dim {args.dim}, {args.layers} "
             f"blocks, context {args.context}), batch {args.batch}, FP16, AdamW lr {LR} as a "
             f"tensor decayed every step, loss scale from 2**24 (the first steps overflow and "
             f"are skipped), {args.steps} timed steps after 3 untimed.", "",
             "Step \"compiled\": the model and `opt.step` compiled apart (torch's "
             "recommendation); \"compiled, optimizer half as one graph\": the model compiled, "
             "and `scaler.step(opt); scaler.update(); opt.zero_grad()` compiled as one "
             "function, with `fullgraph=True` for fusedamp (torch.amp's cannot be one graph, "
             "so it is compiled with its breaks); \"compiled autograd\": the whole step "
             "function compiled with `torch._dynamo.config.compiled_autograd=True` (dynamo "
             "graphs, and the backward graphs compiled autograd captured, counted apart).", "",
             "| framework | step | step ms (median) | fusedamp / torch.amp | first call s | "
             "graphs | backward graphs | graph breaks | recompiles |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        other = by[("torch", r["mode"])]
        ratio = r["step_ms"] / other["step_ms"] if r["framework"] == "fusedamp" else None
        captures = r.get("autograd_captures", "") if r["mode"] == "compiled autograd" else ""
        lines.append(
            f"| {'fusedamp' if r['framework'] == 'fusedamp' else 'torch.amp'} | "
            f"{r['mode']} | {r['step_ms']:.1f} | "
            f"{'' if ratio is None else f'{ratio:.2f}'} | {r['first_call_s']:.2f} | "
            f"{r.get('graphs', '')} | {captures} | {r.get('graph_breaks', '')} | "
            f"{r.get('recompiles', '')} |")
    lines += ["", "The optimizer half (`scaler.step(opt); scaler.update(); opt.zero_grad()`) "
              "under `torch.compile(fullgraph=True)`:", ""]
    for fw, err in fullgraph.items():
        name = "fusedamp" if fw == "fusedamp" else "torch.amp (fused AdamW)"
        lines.append(f"- {name}: " + ("one graph" if err is None else f"fails: `{err}`"))
    lines += ["", "Graph-break reasons of the compiled steps (torch._dynamo's counters, first "
              "line of each):", ""]
    for r in rows:
        if r["mode"] != "eager":
            for reason in r.get("break_reasons", []):
                lines.append(f"- {r['framework']}, {r['mode']}: {reason}")
    te, tc = by[("torch", "eager")], by[("torch", "compiled")]
    fe, fc = by[("fusedamp", "eager")], by[("fusedamp", "compiled")]
    ta, fa = by[("torch", "compiled autograd")], by[("fusedamp", "compiled autograd")]
    th = by[("torch", "compiled, optimizer half as one graph")]
    fh = by[("fusedamp", "compiled, optimizer half as one graph")]
    one_graph = [fw for fw, err in fullgraph.items() if err is None]
    lines += ["", "## Reading", "",
              f"Compiling changed torch.amp's step time by {tc['step_ms'] / te['step_ms']:.2f}x "
              f"and fusedamp's by {fc['step_ms'] / fe['step_ms']:.2f}x; compiled, fusedamp's step "
              f"took {fc['step_ms'] / tc['step_ms']:.2f}x torch.amp's; with the optimizer half "
              f"compiled as one function, {fh['step_ms'] / th['step_ms']:.2f}x ({fh['graphs']} "
              f"graphs and {fh['graph_breaks']} breaks for fusedamp, {th['graphs']} and "
              f"{th['graph_breaks']} for torch.amp). With compiled autograd "
              f"the whole step took {ta['graphs']} dynamo graphs and {ta['autograd_captures']} "
              f"backward captures for torch.amp ({ta['step_ms'] / te['step_ms']:.2f}x its eager "
              f"step), {fa['graphs']} and {fa['autograd_captures']} for fusedamp "
              f"({fa['step_ms'] / fe['step_ms']:.2f}x). "
              + ("The optimizer half is one graph for: " + ", ".join(one_graph) + ". "
                 if one_graph else "Neither optimizer half is one graph. ")
              + "fusedamp's scaler and optimizer steps enter a graph as its own operators "
              "(fusedamp.compiled_step), which run the C++ engine's eager step: one fused pass "
              "without a host sync, the same bits as eager. What still breaks its compiled "
              "autograd step: " + ("; ".join(fa.get("break_reasons", [])) or "nothing")
              + ". On this CPU the FP16 forward and backward dominate the step either way.", ""]
    text = "\n".join(lines) + "\n"
    out = res.out_dir(args)
    if out is not None:
        res.write_results(out, "compile_cpu", {"machine": info, "args": res.recorded(args),
                                              "rows": rows, "fullgraph": fullgraph}, text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
