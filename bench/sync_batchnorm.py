"""SyncBatchNorm across two GPUs: cunorm.torch.SyncBatchNorm against
torch.nn.SyncBatchNorm, one training step per rank (forward, then backward
of a fixed dy), float32 and bfloat16 under autocast (float32 parameters),
channels-last and channels-first x, three ResNet shapes (x per rank).
Each step is timed with CUDA events on every rank after a barrier; the
kinds (torch's layer, cunorm's, the skeleton) alternate, ROUNDS rounds of
STEPS steps each after WARMUP warm-up steps, so a drift of the host's
speed reaches every kind alike; a kind's time is the median of its
rounds' medians, and rank 0 reports the slower rank's. The two layers
start from the same parameters
and buffers; after the timed steps their y, dx, dweight and running
buffers are compared (max error relative to torch's largest value).
A skeleton step is timed the same way: an autograd Function with the
same two collectives (the statistics gathered forward, the sums
backward) and one copy of x forward and of dy backward, the least any
SyncBatchNorm built on torch.distributed and autograd costs per step.
Each step is also timed with the host ahead ("GPU time"): a sleep kernel
first holds the stream while the host queues the whole step, so the
events time the GPU's work alone, as inside a network whose other layers
keep the GPU busy.

Whole models: a DistributedDataParallel training step (forward, cross
entropy, backward, SGD step) of timm's resnet50, batch 32 a rank at 224
x 224, channels-last, fp32 and bf16 autocast, with its BatchNorm layers
as torch's BatchNorm (no synchronization), torch's SyncBatchNorm and
cunorm's, alternating: the median of five rounds' medians of 10 steps,
the slower rank's.

    torchrun --nproc-per-node 2 bench/sync_batchnorm.py OUT.json
"""
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

import cunorm.torch as ct

SHAPES = [(32, 256, 56, 56), (64, 64, 112, 112), (32, 2048, 7, 7)]
ROUNDS, STEPS, WARMUP = 5, 10, 5


class _SkeletonFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        stats = torch.empty(3, x.shape[1], device=x.device)
        out = torch.empty((dist.get_world_size(),) + tuple(stats.shape), device=x.device)
        dist.all_gather_into_tensor(out, stats)
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        sums = torch.empty(dy.shape[1], 2, device=dy.device)
        out = torch.empty((dist.get_world_size(),) + tuple(sums.shape), device=dy.device)
        dist.all_gather_into_tensor(out, sums)
        return dy.clone()


class Skeleton(torch.nn.Module):
    def forward(self, x):
        return _SkeletonFunction.apply(x)


#: cycles of the sleep kernel that keeps the GPU busy while the host
#: queues a step (about 10 ms at an H100's clock, above any step's host time)
HOST_AHEAD_CYCLES = 20_000_000


def _step(layer, x, dy, autocast, host_ahead):
    """One timed step: (ms, y, dx)."""
    xi = x.detach().requires_grad_()
    dist.barrier()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if host_ahead:
        torch.cuda._sleep(HOST_AHEAD_CYCLES)
    start.record()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        y = layer(xi)
    y.backward(dy)
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop), y, xi.grad


def step_times(layers: dict, x, dy, autocast, host_ahead=False) -> dict:
    """{name: (ms, y, dx)} of each layer's step, the layers alternating
    (ROUNDS rounds of STEPS steps), ms the median of the rounds' medians on
    the slower rank; y and dx of its last step."""
    medians, last = {name: [] for name in layers}, {}
    for name, layer in layers.items():
        for _ in range(WARMUP):
            _step(layer, x, dy, autocast, host_ahead)
    for _ in range(ROUNDS):
        for name, layer in layers.items():
            times = []
            for _ in range(STEPS):
                ms, y, dx = _step(layer, x, dy, autocast, host_ahead)
                times.append(ms)
            medians[name].append(statistics.median(times))
            last[name] = (y.detach(), dx)
    t = torch.tensor([statistics.median(medians[name]) for name in layers], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {name: (float(ms), *last[name]) for name, ms in zip(layers, t.tolist())}


def communicator_bytes() -> int:
    """The GPU memory cunorm's NCCL communicator over the default group
    takes once made and connected for the statistics' all-gather (torch's
    own communicator made first, by a barrier; 0 where torch.distributed's
    collective serves)."""
    from cunorm.torch import _collectives

    dist.barrier()
    torch.cuda.synchronize()
    free, reserved = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
    block = torch.zeros(4 * 2048 * 3, device="cuda")
    _collectives.all_gather(block, 0, 2048 * 3, 2048 * 3, dist.group.WORLD, dist.get_world_size())
    torch.cuda.synchronize()
    taken = free - torch.cuda.mem_get_info()[0] - (torch.cuda.memory_reserved() - reserved)  # (not torch's)
    return taken if _collectives.communicator(dist.group.WORLD, torch.cuda.current_device()) else 0


MODEL_STEPS, MODEL_WARMUP, MODEL_ROUNDS = 10, 3, 5


def model_rows(rank):
    """resnet50 DDP training steps with each kind of BatchNorm layer: the
    kinds alternate, MODEL_ROUNDS rounds of MODEL_STEPS steps each, so a
    drift of the host's speed reaches every kind alike; a kind's time is
    the median of its rounds' medians."""
    import copy

    import timm
    from torch.nn.parallel import DistributedDataParallel

    rows = []
    torch.manual_seed(0)
    base = timm.create_model("resnet50").cuda().to(memory_format=torch.channels_last)
    gen = torch.Generator(device="cuda").manual_seed(200 + rank)
    x = torch.randn((32, 3, 224, 224), device="cuda", generator=gen).contiguous(memory_format=torch.channels_last)
    target = torch.randint(0, 1000, (32,), device="cuda", generator=gen)
    convert = {"torch BatchNorm (no sync)": lambda m: m,
               "torch SyncBatchNorm": torch.nn.SyncBatchNorm.convert_sync_batchnorm,
               "cunorm SyncBatchNorm": ct.convert_sync_batchnorm}
    for dtype_name, autocast in (("fp32", False), ("bf16 autocast", True)):
        row = {"model": "timm resnet50", "batch": 32, "dtype": dtype_name}
        runs = {}
        for name, conv in convert.items():
            model = DistributedDataParallel(conv(copy.deepcopy(base)), device_ids=[rank])
            runs[name] = (model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9), [])

        def steps(model, opt, count):
            times = []
            for _ in range(count):
                dist.barrier()
                torch.cuda.synchronize()
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                    loss = torch.nn.functional.cross_entropy(model(x), target)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                stop.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(stop))
            return times

        for model, opt, _ in runs.values():
            steps(model, opt, MODEL_WARMUP)
        for _ in range(MODEL_ROUNDS):
            for model, opt, medians in runs.values():
                medians.append(statistics.median(steps(model, opt, MODEL_STEPS)))
        for name, (_, _, medians) in runs.items():
            t = torch.tensor([statistics.median(medians)], device="cuda")
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            row[f"{name} ms"] = float(t)
        row["torch SyncBatchNorm / cunorm"] = row["torch SyncBatchNorm ms"] / row["cunorm SyncBatchNorm ms"]
        if rank == 0:
            print(json.dumps(row), flush=True)
        rows.append(row)
        del runs
    return rows


def relative(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def main(out_path):
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    rows = []
    nccl_bytes = communicator_bytes()
    for shape in SHAPES:
        for dtype_name, autocast in (("fp32", False), ("bf16 autocast", True)):
            for layout in ("channels-last", "channels-first"):
                gen = torch.Generator(device="cuda").manual_seed(100 + rank)
                x = torch.randn(shape, device="cuda", generator=gen) * 2 + 1
                dy = torch.randn(shape, device="cuda", generator=gen)
                if autocast:
                    x, dy = x.bfloat16(), dy.bfloat16()
                if layout == "channels-last":
                    x, dy = (t.contiguous(memory_format=torch.channels_last) for t in (x, dy))
                layers = {}
                for name, cls in (("torch", torch.nn.SyncBatchNorm), ("cunorm", ct.SyncBatchNorm)):
                    torch.manual_seed(0)
                    layer = cls(shape[1]).cuda()
                    with torch.no_grad():
                        layer.weight.uniform_(0.5, 1.5)
                        layer.bias.uniform_(-0.5, 0.5)
                    layers[name] = layer
                row = {"shape": list(shape), "dtype": dtype_name, "layout": layout, "world": dist.get_world_size()}
                timed = step_times({**layers, "skeleton": Skeleton()}, x, dy, autocast)
                for name in ("torch", "cunorm", "skeleton"):
                    row[f"{name}_ms"] = timed[name][0]
                results = {name: (timed[name][1], timed[name][2], layer.weight.grad, layer.running_mean,
                                  layer.running_var) for name, layer in layers.items()}
                for name, (ms, _, _) in step_times(layers, x, dy, autocast, host_ahead=True).items():
                    row[f"{name}_gpu_ms"] = ms
                row["speedup"] = row["torch_ms"] / row["cunorm_ms"]
                row["gpu_speedup"] = row["torch_gpu_ms"] / row["cunorm_gpu_ms"]
                row["torch_over_skeleton"] = row["torch_ms"] / row["skeleton_ms"]
                for i, what in enumerate(("y", "dx", "dw", "running_mean", "running_var")):
                    row[f"err_{what}"] = relative(results["cunorm"][i], results["torch"][i])
                if rank == 0:
                    print(json.dumps(row), flush=True)
                rows.append(row)
                del layers, results, x, dy
                torch.cuda.empty_cache()
    models = model_rows(rank)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "nccl": ".".join(map(str, torch.cuda.nccl.version())), "communicator_bytes": nccl_bytes,
                       "rows": rows, "models": models}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.environ.get("OUT", "."), "sync_batchnorm.json"))
