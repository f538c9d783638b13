#!/usr/bin/env python3
"""Gradient release (fusedamp.release_gradients) against the normal step: memory held per
parameter and iteration time, side by side in one process.

Memory: a GPT-2-124M-shaped model (transformers' GPT2Config defaults, built from the config, no
download) trained two iterations in each mode; then the bytes of the unique storages of the
weights, the gradients and the optimizer state (by the state key that first names a storage),
and the peak of the gradient bytes alive during backward (a post-accumulate-grad hook,
registered before the release hooks, sums the gradients alive each time one arrives).
Activations, the same in both modes, are not counted. torch's CPU allocator keeps no
statistics, so storages are what is measured.

Time: forward + backward + step of a small GPT-2 and of the 124M shape, both modes taking turns,
median wall and CPU time (time.process_time) per iteration and the median of the per-round ratios.

    PYTHONPATH=python python3 benchmarks/bench_release.py [--rounds 15] [--threads 1]
"""
from __future__ import annotations

import itertools
import statistics
import time

import torch

import harness
from harness import results as res
from harness.machine import machine_info, working_tree

harness.use_paths("python")
import fusedamp  # noqa: E402

CONFIGS = {
    "bf16 + int8 state + split8 masters": dict(dtype=torch.bfloat16, scaled=False, opt=dict(
        master_weights="split8", state_dtype=torch.int8)),
    "fp16 + fp32 masters (loss scaling)": dict(dtype=torch.float16, scaled=True, opt=dict(
        master_weights=True)),
}


def gpt2(dtype, seed=0, **shape):
    import transformers
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**shape)).to(dtype)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab, (1, 32), generator=gen) for _ in range(2)]

    def loss_of(i):
        x = ids[i % 2]
        return torch.nn.functional.cross_entropy(
            model(input_ids=x, use_cache=False).logits.float().flatten(0, 1), x.flatten())
    return model, loss_of


class Setup:
    """A model, its fusedamp AdamW (and scaler) in one mode."""

    def __init__(self, config, release, **shape):
        self.model, self.loss_of = gpt2(config["dtype"], **shape)
        self.opt = fusedamp.optim.AdamW(self.model.parameters(), lr=1e-4, **config["opt"])
        self.scaler = fusedamp.GradScaler("cpu", init_scale=2.0 ** 12) if config["scaled"] \
            else None
        self.release = release
        self.peak_grads = 0
        self.params = list(self.model.parameters())
        self.watch = []
        self.handle = None

    def watch_grads(self):
        def seen(_):
            alive = sum(p.grad.untyped_storage().nbytes() for p in self.params
                        if p.grad is not None)
            self.peak_grads = max(self.peak_grads, alive)
        self.watch = [p.register_post_accumulate_grad_hook(seen) for p in self.params]

    def attach(self):
        if self.release:
            self.handle = fusedamp.release_gradients(self.model, self.opt, self.scaler)

    def iteration(self, i):
        if not self.release:
            self.opt.zero_grad()
        loss = self.loss_of(i)
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        if not self.release:
            self.scaler.step(self.opt) if self.scaler else self.opt.step()
        if self.scaler:
            self.scaler.update()
        return loss


def unique_bytes(tensors, seen):
    total = 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def held(setup):
    seen = set()
    out = {"weights": unique_bytes(setup.params, seen),
           "grads": unique_bytes([p.grad for p in setup.params if p.grad is not None], seen)}
    for p in setup.params:
        for key, v in setup.opt.state[p].items():
            if torch.is_tensor(v):
                out[f"state: {key}"] = out.get(f"state: {key}", 0) + unique_bytes([v], seen)
    return out


def measure_memory(rows, doc):
    for name, config in CONFIGS.items():
        for release in (False, True):
            s = Setup(config, release)
            s.watch_grads()
            s.attach()
            t0 = time.perf_counter()
            for i in range(2):
                loss = s.iteration(i)
            secs = (time.perf_counter() - t0) / 2
            n = sum(p.numel() for p in s.params)
            parts = held(s)
            total = sum(parts.values())
            weights_state = total - parts["grads"]
            row = {"config": name, "mode": "release" if release else "normal", "params": n,
                   "bytes": parts, "held_B_per_param": total / n,
                   "peak_grads_B_per_param": s.peak_grads / n,
                   "peak_in_backward_B_per_param": (weights_state + s.peak_grads) / n,
                   "seconds_per_iteration": secs, "last_loss": loss.item()}
            doc["memory"].append(row)
            rows.append([name, row["mode"], f"{n:,}"] +
                        [f"{parts.get(k, 0) / n:.3f}" for k in ("weights", "grads")] +
                        [f"{weights_state / n - parts['weights'] / n:.3f}",
                         f"**{total / n:.3f}**", f"{s.peak_grads / n:.3f}",
                         f"{(weights_state + s.peak_grads) / n:.3f}"])
            print(row, flush=True)
            if s.handle:
                s.handle.remove()
            for h in s.watch:
                h.remove()
            del s


# The iteration-time models: a small GPT-2, where the hooks' host cost shows most, and the
# 124M shape (fewer rounds: an iteration takes seconds).
TIME_SHAPES = {"GPT-2, 4 layers, width 256, vocab 4096": (dict(
    vocab_size=4096, n_positions=128, n_embd=256, n_layer=4, n_head=4), 1.0),
    "GPT-2 124M": ({}, 1 / 3)}


def measure_time(args, doc):
    out = []
    for (model, (shape, share)), (name, config) in itertools.product(TIME_SHAPES.items(),
                                                                     CONFIGS.items()):
        rounds = max(3, round(args.rounds * share))
        setups = {m: Setup(config, m == "release", **shape) for m in ("normal", "release")}
        for s in setups.values():
            s.attach()
        wall = {m: [] for m in setups}
        cpu = {m: [] for m in setups}
        for r in range(rounds + 2):
            for m in (("normal", "release") if r % 2 == 0 else ("release", "normal")):
                t0, c0 = time.perf_counter(), time.process_time()
                setups[m].iteration(r)
                if r >= 2:  # two warm-up rounds
                    wall[m].append(time.perf_counter() - t0)
                    cpu[m].append(time.process_time() - c0)
        row = {"model": model, "config": name, "shape": shape, "rounds": rounds}
        for m in setups:
            row[f"{m}_wall_ms"] = 1e3 * statistics.median(wall[m])
            row[f"{m}_cpu_ms"] = 1e3 * statistics.median(cpu[m])
        row["paired_wall_ratio"] = statistics.median(
            a / b for a, b in zip(wall["release"], wall["normal"]))
        row["paired_cpu_ratio"] = statistics.median(
            a / b for a, b in zip(cpu["release"], cpu["normal"]))
        doc["time"].append(row)
        out.append([model, name, rounds, f"{row['normal_wall_ms']:.1f}",
                    f"{row['release_wall_ms']:.1f}", f"{row['paired_wall_ratio']:.3f}",
                    f"{row['normal_cpu_ms']:.1f}",
                    f"{row['release_cpu_ms']:.1f}", f"{row['paired_cpu_ratio']:.3f}"])
        print(row, flush=True)
        del setups
    return out


def header(title, script, doc):
    """A results file's first lines: title, command, machine, tree, load at start and end."""
    doc["machine"]["load_average_at_end"] = harness.machine.load_average()
    m = doc["machine"]
    dirty = " + uncommitted changes" if doc["tree"]["uncommitted_changes"] else ""
    return [title, "", f"`{res.command(script)}`", "",
            f"{res.machine_sentence(m)} Tree: {doc['tree']['commit']}{dirty}. Load average "
            f"{m.get('load_average_at_start')} at start, {m.get('load_average_at_end')} at end.",
            ""]


def write(args, stem, doc, md):
    """Prints the tables and writes the results files (unless --no-files)."""
    folder = res.out_dir(args)
    if folder:
        res.write_results(folder, stem, doc, "\n".join(md) + "\n")
    print("\n".join(md))


def main():
    ap = res.parser(__doc__)
    ap.add_argument("--rounds", type=int, default=15)
    res.add_threads(ap)
    res.add_output(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    doc = {"machine": machine_info("cpu"), "tree": working_tree(), "args": res.recorded(args),
           "memory": [], "time": []}
    mem_rows = []
    measure_memory(mem_rows, doc)
    time_rows = measure_time(args, doc)
    md = header("# Gradient release: memory per parameter and iteration time (CPU)", __file__,
                doc) + [
          "## Memory held, bytes per parameter (GPT-2 124M shape, after 2 iterations)", "",
          "Unique storages of the weights, the gradients and the optimizer state (every state "
          "tensor: masters or remainders, moments, 8-bit block scales, step counts); peak: the "
          "weights and state plus the most gradient bytes alive at once during backward. "
          "Activations are not counted (the same in both modes).", ""]
    md += res.table(["config", "mode", "params", "weights", "grads", "state", "held",
                     "peak grads in backward", "peak in backward"],
                    "lllrrrrrr", mem_rows)
    md += ["", "## Iteration time, forward + backward + step (batch 1 x 32 tokens)", "",
           "Median over the rounds after 2 warm-up rounds, the modes taking turns (the order "
           "alternating each round); ratio: median of the per-round release / normal.", ""]
    md += res.table(["model", "config", "rounds", "normal ms", "release ms", "ratio",
                     "normal CPU ms", "release CPU ms", "CPU ratio"], "llrrrrrrr", time_rows)
    write(args, "release_cpu", doc, md)


if __name__ == "__main__":
    main()
