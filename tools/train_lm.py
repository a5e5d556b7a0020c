"""Train a tiny causal transformer LM on packed token shards with sequence packing, on the CPU.

    shardloader pack corpus/ packed/ --format tokens --tokenizer tokenizer.json   # JSONL "text"
    python tools/train_lm.py packed/ --steps 50 --seq-len 64 --rows 8
    python -m torch.distributed.run --standalone --nproc_per_node 2 tools/train_lm.py packed/
    python tools/train_lm.py packed/ --mix web=0.7,code=0.3     # packed/web and packed/code
    python tools/train_lm.py web=packed_web/ code=packed_code/ --mix web=0.7,code=0.3
    # 2 data-parallel replicas x 2 tensor-parallel ranks; a DCP checkpoint after 20 steps,
    # then the rest of the epoch on 1 replica x 2
    python -m torch.distributed.run --standalone --nproc_per_node 4 tools/train_lm.py packed/ \
        --tp 2 --steps 20 --save ckpt/
    python -m torch.distributed.run --standalone --nproc_per_node 2 tools/train_lm.py packed/ \
        --tp 2 --resume ckpt/ --epochs 1 --steps 100000

Documents are packed into rows of ``--seq-len`` tokens, ``--rows`` rows per batch: the data
side is the README's "Language models" recipe.  On token shards (``--format tokens``, the
default ``--packing auto``) ``shardloader.batching.TokenBlocks`` cuts each row straight out of
a shard's token stream (documents run on across rows, every token delivered once); on tar or
Arrow shards (or ``--packing documents``) ``PackedBatches`` plans from the per-sample token
counts in the sidecar index, cutting only documents longer than a row, and builds the
``PackCollate`` that fills the rows in the worker.
Attention is block-diagonal: a token sees only the earlier tokens of its own segment, read off
``position_ids`` (which restart at every document or piece), and no position is scored across
a segment boundary (``labels`` are -100 there).
With ``--mix NAME=WEIGHT,...`` the data is a ``shardloader.Mixture`` of packed datasets (one
tokenizer), blended so every prefix of the stream holds each source's share within one
document, each source cycling through its own reshuffled epochs (a mixture epoch is
``--mix-epoch`` documents, default all sources' together); rows are packed from the blend
with ``PackedBatches``, and the plan's per-source counts are printed.
Padding uses id ``vocab_size``, an embedding row of its own, so it can never be a real token.
With ``--tp N`` the ranks form a ``DeviceMesh`` of ``world / N`` data-parallel replicas x ``N``
tensor-parallel ranks (torch's ``parallelize_module``: attention and MLP projections split
column- then row-wise); the dataset takes the mesh's ``"dp"`` dimension, so a replica's ranks
read the same rows (checked every step) and only the replicas split the data; gradients are
averaged over the replicas.  ``--save DIR`` writes a ``torch.distributed.checkpoint`` of the
model, optimizer, step and the loader after the last step; ``--resume DIR`` loads one, at any
number of replicas (the loader's state names no rank).
``shardloader.monitor`` times data wait against the step; the data-bound share is printed.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import shardloader as sl
from shardloader.batching import PackedBatches, TokenBlocks
from shardloader.deliver.monitor import all_ranks, monitor

IGNORE = -100


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)
        # under tensor parallelism q/k/v hold this rank's heads only
        q, k, v = (f(h).view(b, t, -1, d // self.heads).transpose(1, 2) for f in self.qkv)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
        x = x + self.out(y.transpose(1, 2).reshape(b, t, -1))
        return x + self.mlp(self.ln2(x))

    @property
    def qkv(self) -> tuple[nn.Module, nn.Module, nn.Module]:
        return self.q, self.k, self.v


class TinyLM(nn.Module):
    def __init__(self, vocab: int, seq_len: int, d: int = 64, heads: int = 2, layers: int = 2):
        super().__init__()
        self.tok = nn.Embedding(vocab + 1, d, padding_idx=vocab)  # row `vocab`: padding
        self.pos = nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        # a new segment (document or padding run) starts wherever position_ids restarts at 0
        segment = torch.cumsum((position_ids == 0).long(), dim=1)
        t = input_ids.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        allowed = (segment[:, :, None] == segment[:, None, :]) & causal
        x = self.tok(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x, allowed)
        return self.head(self.ln(x))


def setup_distributed() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def tensor_parallel(model: TinyLM, mesh: Any) -> None:
    """Split each block's projections over the mesh's "tp" ranks (Megatron's layout)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    col, row = ColwiseParallel(), RowwiseParallel()
    plan = {"q": col, "k": col, "v": col, "out": row, "mlp.0": col, "mlp.2": row}
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], plan)


def average_over_replicas(model: nn.Module, group: Any, replicas: int) -> None:
    """What DDP does for a mesh: each gradient (a rank's shard, under tensor parallelism)
    averaged over the data-parallel group."""
    for p in model.parameters():
        if p.grad is not None:
            local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            dist.all_reduce(local, group=group)
            local /= replicas


def same_rows(batch: dict[str, Any], group: Any, step: int) -> None:
    """Fail when the tensor-parallel ranks of a replica got different rows."""
    ids = batch["input_ids"].to(torch.int64).flatten()
    check = (ids * torch.arange(1, ids.numel() + 1)).sum().reshape(1)
    low, high = check.clone(), check.clone()
    dist.all_reduce(low, dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, dist.ReduceOp.MAX, group=group)
    if low.item() != high.item():
        raise SystemExit(f"step {step}: the tensor-parallel ranks of a replica got other rows")


class TrainState:
    """Model, optimizer, step and epoch as one ``Stateful`` for DCP (resharded on load)."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt, self.step = model, opt, 0

    def state_dict(self) -> dict[str, Any]:
        model, optim = get_state_dict(self.model, self.opt)
        return {"model": model, "optim": optim, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        self.step = int(state["step"])


def vocab_size(manifest: sl.Manifest, given: int) -> int:
    if given:
        return given
    tok: Any = manifest.extra.get("tokenizer") or {}
    if "vocab_size" in tok:
        return int(tok["vocab_size"])
    raise SystemExit("the manifest records no tokenizer vocabulary; pass --vocab-size")


def parse_mix(text: str) -> dict[str, float]:
    """``web=0.7,code=0.3`` → ``{"web": 0.7, "code": 0.3}``."""
    weights = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        try:
            weights[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep or not name.strip():
            raise SystemExit(f"--mix takes NAME=WEIGHT,... (e.g. web=0.7,code=0.3), got {text!r}")
    return weights


def mix_sources(data: list[str], names: list[str]) -> dict[str, str]:
    """``NAME=URL`` arguments, or one folder holding a packed dataset per name."""
    if len(data) == 1 and "=" not in data[0]:
        return {n: os.path.join(data[0], n) for n in names}
    sources = dict(d.partition("=")[::2] for d in data)
    if sorted(sources) != sorted(names) or not all(sources.values()):
        raise SystemExit(f"with --mix, give NAME=URL for each of {names} (got {data})")
    return {n: sources[n] for n in names}


def train(args: argparse.Namespace) -> int:
    rank, world = setup_distributed()
    mesh = None
    if args.tp > 1:
        if world % args.tp:
            raise SystemExit(f"--tp {args.tp} does not divide the {world} ranks")
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING, format=f"[rank {rank}] %(message)s"
    )
    weights = parse_mix(args.mix) if args.mix else None
    sources = mix_sources(args.data, list(weights)) if weights else {"": args.data[0]}
    vocabs = set()
    for url in sources.values():
        manifest, _ = sl.read_manifest(url)
        if manifest.fields.get("tokens") is None or manifest.fields["tokens"].codec != "tokens":
            raise SystemExit(
                f"{url} has no token field (fields: {', '.join(manifest.fields)});"
                " pack text with --tokenizer tokenizer.json"
            )
        vocabs.add(vocab_size(manifest, args.vocab_size))  # pad with id `vocab`: its own row
    if len(vocabs) > 1:
        raise SystemExit(f"the sources were packed with different tokenizers ({vocabs})")
    vocab = vocabs.pop()
    packing = args.packing
    if packing == "auto":
        packing = "blocks" if manifest.format == "tokens" and not weights else "documents"
    if packing == "blocks" and weights:
        raise SystemExit("--mix packs rows from the blend: use --packing documents (or auto)")
    planner: Any
    if packing == "blocks":
        planner = TokenBlocks(seq_len=args.seq_len, rows_per_batch=args.rows, pad_id=vocab)
    else:
        planner = PackedBatches(seq_len=args.seq_len, rows_per_batch=args.rows, pad_id=vocab)
    read = sl.ReadOptions(cache=sl.CacheOptions(dir=args.cache_dir)) if args.cache_dir else None
    ds: sl.ShardedDataset
    if weights:
        ds = sl.Mixture(
            sources,
            weights,
            epoch_samples=args.mix_epoch,
            planner=planner,
            shuffle=True,
            seed=args.seed,
            read=read,
        )
    else:
        ds = sl.ShardedDataset(
            args.data[0], planner=planner, shuffle=True, seed=args.seed, read=read
        )
    # with a mesh: rank and world are the replica's, so a replica's ranks read the same rows
    if mesh is not None:
        ds.set_world(sl.World.of(mesh["dp"]))
    loader = sl.make_loader(ds, num_workers=args.workers)
    if rank == 0:
        plan = ds.report()
        # delivered + repeated (padding repeats, a mixture's second own epochs) + padding
        # = every slot of the epoch's rows
        slots = plan.token_slots or 0
        repeated = plan.repeated_tokens or 0
        padding = slots - (plan.tokens or 0) - repeated
        print(
            f"{type(planner).__name__}, epoch 0: {plan.steps_per_rank} steps per rank; tokens "
            f"{plan.tokens} delivered, {repeated} repeated, "
            f"{plan.truncated_tokens} truncated, {plan.dropped_tokens} dropped; "
            f"{padding} of {slots} slots padding ({plan.pad_fraction:.1%})",
            flush=True,
        )
        for name, counts in getattr(plan, "sources", {}).items():
            print(
                f"  source {name}: weight {counts.weight:.2f}, {counts.samples} documents, "
                f"{counts.tokens} tokens, own epoch {counts.epoch} "
                f"({counts.epochs_started} started)",
                flush=True,
            )
    model: nn.Module = TinyLM(vocab, args.seq_len, d=args.dim)
    if mesh is not None:
        tensor_parallel(model, mesh)  # type: ignore[arg-type]
    elif world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    state = TrainState(model, opt)
    if args.resume:  # the loader's state is the same on every rank: any world size loads it
        dcp.load({"train": state, "dataloader": loader}, checkpoint_id=args.resume)
        if rank == 0:
            print(f"resumed {args.resume} at step {state.step}, epoch {ds.epoch}", flush=True)
    timed = monitor(loader, interval=args.log_every)
    step, epoch = state.step, ds.epoch
    start, tokens = step, 0
    record = None
    if args.record:
        os.makedirs(args.record, exist_ok=True)
        record = open(os.path.join(args.record, f"rank{rank}.jsonl"), "a")  # noqa: SIM115
    while step < args.steps and epoch < args.epochs:
        ds.set_epoch(epoch)  # keeps a resumed position in that epoch
        for batch in timed:
            if mesh is not None:
                same_rows(batch, mesh["tp"].get_group(), step)
            if record is not None:
                real = batch["input_ids"][batch["attention_mask"].bool()].tolist()
                coord = [0, 0] if mesh is None else mesh.get_coordinate()
                record.write(json.dumps({"dp": coord[0], "tp": coord[1], "tokens": real}) + "\n")
            ids, labels = batch["input_ids"], batch["labels"]
            logits = model(ids, batch["position_ids"])
            # logits at t predict the token at t + 1; labels are -100 at padding, at every
            # segment start (nothing learns across a document boundary) and on rows repeated
            # for equal steps (__pad__): a batch of repeats alone has no label, so the sum is
            # divided by at least 1 (a zero step) where a mean would be NaN
            targets = labels[:, 1:].reshape(-1)
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, vocab), targets, ignore_index=IGNORE, reduction="sum"
            ) / (targets != IGNORE).sum().clamp(min=1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if mesh is not None and mesh["dp"].size() > 1:
                average_over_replicas(model, mesh["dp"].get_group(), mesh["dp"].size())
            opt.step()
            step += 1
            tokens += int(batch["attention_mask"].sum())
            if rank == 0 and (step % args.log_every == 0 or step == args.steps):
                print(
                    f"step {step} epoch {epoch} loss {loss.item():.4f} "
                    f"(ppl {math.exp(min(loss.item(), 20)):.1f})",
                    flush=True,
                )
            if step >= args.steps:
                break
        epoch += 1
    if record is not None:
        record.close()
    if args.save:  # mid-epoch, unless the epoch ended with the last step
        state.step = step
        dcp.save({"train": state, "dataloader": loader}, checkpoint_id=args.save)
    total = all_ranks(timed.stats())
    if rank == 0 and mesh is not None:
        print(
            f"{mesh['dp'].size()} replica(s) x {args.tp} tensor-parallel ranks: a replica's "
            f"ranks read the same rows at each of {step - start} steps",
            flush=True,
        )
    if rank == 0 and args.save:
        print(f"saved {args.save} at step {step}: {loader.state_dict()}", flush=True)
    if rank == 0:
        fill = tokens / (max(step - start, 1) * args.rows * args.seq_len)
        where = f" (all {world} ranks)" if world > 1 else ""
        print(f"rows {fill:.0%} filled with real tokens (rank 0)", flush=True)
        print(f"{total.summary()}{where}", flush=True)
        print(f"reading: {total.advice}", flush=True)
    if world > 1:
        # Free DDP's reducer (it holds the process group) and let gloo's threads finish
        # while the group lives: destroying the group from the reducer at exit deadlocks
        # (its destructor waits, holding the GIL, on a gloo thread that needs the GIL).
        model = state = None
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "data",
        nargs="+",
        help="packed dataset with a tokens field (folder or URL); with --mix: NAME=URL per "
        "source, or one folder holding a packed dataset per source name",
    )
    p.add_argument("--mix", default=None, help="blend sources by weight: web=0.7,code=0.3")
    p.add_argument(
        "--mix-epoch",
        type=int,
        default=None,
        help="documents per mixture epoch (default: all sources' together)",
    )
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--rows", type=int, default=8, help="rows (sequences) per batch")
    p.add_argument("--workers", type=int, default=2, help="DataLoader num_workers per rank")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--vocab-size", type=int, default=0, help="default: from the manifest")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per replica")
    p.add_argument("--epochs", type=int, default=1 << 30, help="stop at the end of this epoch")
    p.add_argument("--save", default=None, help="DCP checkpoint folder, written at the end")
    p.add_argument("--resume", default=None, help="DCP checkpoint folder to start from")
    p.add_argument("--record", default=None, help="folder: each rank's real tokens per step")
    p.add_argument(
        "--packing",
        choices=("auto", "blocks", "documents"),
        default="auto",
        help="blocks: TokenBlocks (token shards); documents: PackedBatches; auto: by format",
    )
    args = p.parse_args(argv)
    if min(args.steps, args.seq_len, args.rows, args.log_every, args.dim, args.tp) < 1:
        p.error("--steps, --seq-len, --rows, --log-every, --dim, --tp must be >= 1")
    if args.workers < 0:
        p.error("--workers must be >= 0")
    if len(args.data) > 1 and not args.mix:
        p.error("several data arguments need --mix NAME=WEIGHT,...")
    return args


if __name__ == "__main__":
    sys.exit(train(parse()))
