"""Collates: dynamic padding and masks (hypothesis), explicit pad errors, detection, packing."""

from __future__ import annotations

import datetime
import multiprocessing
import pickle
from itertools import pairwise

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardloader.batching import PackedBatches, batch_ids, pack_rows
from shardloader.collate import (
    IGNORE_INDEX,
    DetectionCollate,
    PackCollate,
    PadCollate,
    collate_samples,
)
from shardloader.errors import MissingFieldError, ShardloaderError, UsageError

PAD = 7  # deliberately not 0: 0 is a real token in these tests

lengths_st = st.lists(st.integers(0, 20), min_size=1, max_size=8)


def _tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30, n).astype(np.uint16)


# -- PadCollate --------------------------------------------------------------------------------


@given(
    lengths_st,
    st.sampled_from(["right", "left"]),
    st.sampled_from(["right", "left"]),
    st.integers(1, 4),
    st.one_of(st.none(), st.integers(1, 6)),
)
def test_padding_and_masks_are_exact(lengths, side, trunc_side, multiple, max_mult):
    max_length = None if max_mult is None else max_mult * multiple
    docs = [_tokens(n, i) for i, n in enumerate(lengths)]
    samples = [{"input_ids": d, "labels": d.astype(np.int64)} for d in docs]
    collate = PadCollate(
        {"input_ids": PAD, "labels": IGNORE_INDEX},
        pad_to_multiple_of=multiple,
        max_length=max_length,
        padding_side=side,
        truncation_side=trunc_side,
    )
    out = collate(samples)
    if max_length is None:
        kept = docs
    elif trunc_side == "right":
        kept = [d[:max_length] for d in docs]
    else:
        kept = [d[max(len(d) - max_length, 0) :] for d in docs]
    lens = [len(k) for k in kept]
    width = -(-max(lens) // multiple) * multiple
    ids, labels, mask = out["input_ids"], out["labels"], out["attention_mask"]
    assert ids.dtype == labels.dtype == mask.dtype == torch.int64
    assert ids.shape == labels.shape == mask.shape == (len(docs), width)
    assert out["lengths"].tolist() == lens
    for i, k in enumerate(kept):
        real = slice(0, len(k)) if side == "right" else slice(width - len(k), width)
        assert ids[i, real].tolist() == k.tolist()
        assert labels[i, real].tolist() == k.tolist()
        assert mask[i].sum() == len(k) and mask[i, real].all()
        pads = torch.ones(width, dtype=torch.bool)
        pads[real] = False
        assert (ids[i, pads] == PAD).all() and (labels[i, pads] == IGNORE_INDEX).all()


def test_missing_pad_value_for_a_token_field_is_an_error_naming_field_and_remedy():
    samples = [{"input_ids": _tokens(3, 0)}, {"input_ids": _tokens(5, 1)}]
    with pytest.raises(UsageError, match=r"'input_ids'.*variable length \(3\.\.5\).*pad_values"):
        PadCollate()(samples)
    with pytest.raises(ValueError):  # also the built-in
        PadCollate({"labels": -100})(samples)
    # float sequences need one too: no dtype-dependent silent default
    with pytest.raises(ShardloaderError, match="'feat'"):
        PadCollate()([{"feat": np.zeros(2, np.float32)}, {"feat": np.zeros(3, np.float32)}])


def test_pad_value_errors_are_explicit():
    with pytest.raises(UsageError, match="integers but its pad value"):
        PadCollate({"x": 0.5})([{"x": np.arange(2)}, {"x": np.arange(3)}])
    with pytest.raises(UsageError, match="multiple"):
        PadCollate({"x": 0}, pad_to_multiple_of=8, max_length=12)
    with pytest.raises(UsageError, match="mask_field"):
        PadCollate({"x": 0}, mask_field="y")
    with pytest.raises(UsageError, match="'attention_mask'"):
        PadCollate({"x": 0})([{"x": [1], "attention_mask": 1}])


def test_default_rules_scalars_strings_nested_and_equal_shapes():
    samples = [
        {
            "i": 1,
            "f": 0.5,
            "b": True,
            "s": "a",
            "raw": b"x",
            "img": np.full((2, 3), k, np.uint8),
            "t": torch.tensor(k),
            "meta": {"ids": _tokens(k + 1, k), "name": f"n{k}", "w": np.float32(k)},
            "none": None,
        }
        for k in range(3)
    ]
    out = PadCollate({"meta.ids": PAD})(samples)
    assert out["i"].dtype == torch.int64 and out["i"].tolist() == [1, 1, 1]
    assert out["f"].dtype == torch.float64 and out["b"].dtype == torch.bool
    assert out["s"] == ["a"] * 3 and out["raw"] == [b"x"] * 3 and out["none"] == [None] * 3
    assert out["img"].shape == (3, 2, 3) and out["img"].dtype == torch.uint8
    assert out["t"].tolist() == [0, 1, 2]
    assert out["meta"]["ids"].shape == (3, 3) and out["meta"]["name"] == ["n0", "n1", "n2"]
    assert out["meta"]["w"].tolist() == [0.0, 1.0, 2.0]
    # the mask describes the first padded field, even when it is nested
    assert out["lengths"].tolist() == [1, 2, 3]
    assert out["attention_mask"].tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


NUMBERS = {
    "ints": [1, 2, 3],
    "floats": [0.5, 2.0],
    "bools": [True, False],
    "bool and int": [True, 2],
    "numpy int32": [np.int32(1), np.int32(2)],
    "numpy float32": [np.float32(1), np.float32(2.5)],
    "numpy bool": [np.bool_(True), np.bool_(False)],
    "numpy uint8": [np.uint8(1), np.uint8(200)],
    "numpy float32 and float64": [np.float32(1), np.float64(2)],
    "numpy int32 then int": [np.int32(1), 5],
}

MIXED_FLOATS = {
    "int and float": [1, 2.5],
    "numpy float32 and float": [np.float32(1), 2.5],
    "int and numpy float32": [1, np.float32(2.5)],
}


@pytest.mark.parametrize("values", NUMBERS.values(), ids=NUMBERS.keys())
def test_numbers_collate_as_torch_default_collate_does(values):
    want = torch.utils.data.default_collate(values)
    got = collate_samples([{"x": v} for v in values])["x"]
    assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("values", MIXED_FLOATS.values(), ids=MIXED_FLOATS.keys())
def test_a_field_mixing_floats_with_other_numbers_is_float64_in_either_order(values):
    # torch's default_collate follows the first value (float32 one way, float64 the other): the
    # dtype of a shuffled field would change from batch to batch
    for ordered in (values, values[::-1]):
        got = collate_samples([{"x": v} for v in ordered])["x"]
        assert got.dtype == torch.float64
        assert got.tolist() == [float(v) for v in ordered]


@pytest.mark.parametrize(
    ("values", "stacks"),
    [
        ([1, 2.5], True),
        ([np.zeros(2), [1.0, 2.0]], True),  # an array and a list of numbers
        ([torch.tensor(1), torch.tensor(2)], True),  # 0-d tensors
        ([1, np.zeros(2)], False),  # a number and an array
        ([[], []], False),  # empty lists
        (["a", "b"], False),
    ],
)
def test_a_missing_value_is_an_error_exactly_where_the_field_would_be_a_tensor(values, stacks):
    full = collate_samples([{"x": v} for v in values])["x"]
    assert isinstance(full, torch.Tensor) == stacks
    samples = [{"x": v} for v in values] + [{"x": None}]
    if stacks:
        with pytest.raises(MissingFieldError, match="'x' is missing"):
            collate_samples(samples)
    else:
        assert collate_samples(samples)["x"] == [*values, None]


def test_lists_of_numbers_tensors_and_two_dim_fields_pad():
    out = PadCollate({"ids": PAD, "emb": 0.0}, mask_field="ids")(
        [
            {"ids": [1, 2], "emb": torch.ones(2, 4)},
            {"ids": [], "emb": torch.ones(0, 4)},
            {"ids": [3], "emb": torch.ones(1, 4)},
        ]
    )
    assert out["ids"].tolist() == [[1, 2], [PAD, PAD], [3, PAD]]
    assert out["emb"].shape == (3, 2, 4) and out["emb"].dtype == torch.float32
    assert out["emb"].sum().item() == 12.0
    assert out["lengths"].tolist() == [2, 0, 1]


def test_equal_lengths_are_still_padded_to_the_multiple_and_masked():
    out = PadCollate({"ids": PAD}, pad_to_multiple_of=4)([{"ids": [1, 2]}, {"ids": [3, 4]}])
    assert out["ids"].tolist() == [[1, 2, PAD, PAD], [3, 4, PAD, PAD]]
    assert out["attention_mask"].tolist() == [[1, 1, 0, 0]] * 2


def test_read_only_token_arrays_from_decoded_bytes():
    """The ``tokens`` codec decodes with np.frombuffer: read-only arrays, no torch warning."""
    raw = [np.arange(n, dtype="<u2").tobytes() for n in (3, 3, 5)]
    docs = [np.frombuffer(b, dtype="<u2") for b in raw]
    assert not docs[0].flags.writeable
    stacked = collate_samples([{"ids": d} for d in docs[:2]])
    assert stacked["ids"].tolist() == [[0, 1, 2]] * 2
    padded = PadCollate({"ids": PAD})([{"ids": d} for d in docs])
    assert padded["ids"][2].tolist() == [0, 1, 2, 3, 4] and padded["ids"].dtype == torch.int64
    packed = PackCollate(seq_len=8, pad_id=PAD)([{"tokens": d} for d in docs])
    assert int(packed["attention_mask"].sum()) == 11


def test_structure_errors():
    with pytest.raises(UsageError, match="empty batch"):
        PadCollate()([])
    # samples may lack fields (tests/test_optional_fields.py); a number field missing in one
    # sample cannot stack into a tensor
    with pytest.raises(MissingFieldError, match="'a' is missing .* in 1 of 2 samples"):
        collate_samples([{"a": 1}, {"b": 1}])
    with pytest.raises(UsageError, match="different shapes"):
        collate_samples([{"img": np.zeros((2, 3))}, {"img": np.zeros((3, 2))}])
    assert collate_samples([{"img": np.zeros((2, 3))}, {"img": np.zeros((3, 2))}], ragged="list")


# -- DetectionCollate --------------------------------------------------------------------------


def _det_samples():
    return [
        {"image": torch.zeros(3, 4, 5), "boxes": torch.ones(2, 4), "labels": torch.tensor([1, 2])},
        {"image": torch.zeros(3, 6, 5), "boxes": torch.ones(0, 4), "labels": torch.tensor([])},
        {"image": torch.zeros(3, 4, 5), "boxes": 2 * torch.ones(3, 4), "labels": torch.ones(3)},
    ]


def test_detection_concat_with_batch_index_and_ragged_images_as_list():
    out = DetectionCollate()(_det_samples())
    assert out["boxes"].shape == (5, 4)
    assert out["batch_index"].tolist() == [0, 0, 2, 2, 2]
    assert isinstance(out["image"], list) and len(out["image"]) == 3


def test_detection_pad_with_count_needs_explicit_pad_values():
    with pytest.raises(UsageError, match="pad value for boxes, labels"):
        DetectionCollate(mode="pad")
    out = DetectionCollate(mode="pad", pad_values={"boxes": -1.0, "labels": -1})(_det_samples())
    assert out["boxes"].shape == (3, 3, 4) and out["num_items"].tolist() == [2, 0, 3]
    assert (out["boxes"][1] == -1).all() and out["labels"][0].tolist() == [1, 2, -1]


def test_detection_counts_must_agree():
    bad = _det_samples()
    bad[0]["labels"] = torch.tensor([1])
    with pytest.raises(UsageError, match="different item counts"):
        DetectionCollate()(bad)


# -- PackCollate -------------------------------------------------------------------------------


def test_pack_collate_exact_small_example():
    docs = [np.array([10, 11, 12]), np.array([20, 21]), np.array([30, 31, 32, 33])]
    out = PackCollate(seq_len=6, pad_id=PAD, rows_per_batch=3)(docs)
    # first-fit: doc0 → row0 (3 left), doc1 → row0 (1 left), doc2 → row1; row2 is empty
    assert out["input_ids"].tolist() == [
        [10, 11, 12, 20, 21, PAD],
        [30, 31, 32, 33, PAD, PAD],
        [PAD] * 6,
    ]
    m = IGNORE_INDEX
    assert out["labels"].tolist() == [
        [m, 11, 12, m, 21, m],
        [m, 31, 32, 33, m, m],
        [m] * 6,
    ]
    assert out["position_ids"].tolist() == [
        [0, 1, 2, 0, 1, 0],
        [0, 1, 2, 3, 0, 1],
        [0, 1, 2, 3, 4, 5],
    ]
    assert out["attention_mask"].tolist() == [[1] * 5 + [0], [1] * 4 + [0, 0], [0] * 6]
    assert out["cu_seqlens"].dtype == torch.int32
    assert out["cu_seqlens"].tolist() == [0, 3, 5, 6, 10, 12, 18]
    assert out["max_seqlen"] == 6


def test_pack_collate_long_documents():
    doc = np.arange(1, 15)  # 14 tokens, seq_len 4
    split = PackCollate(seq_len=4, pad_id=0)([{"tokens": doc, "__key__": "k"}])
    assert split["input_ids"].tolist() == [
        [1, 2, 3, 4],
        [5, 6, 7, 8],
        [9, 10, 11, 12],
        [13, 14, 0, 0],
    ]
    assert split["labels"][:, 0].tolist() == [IGNORE_INDEX] * 4  # each piece starts a segment
    assert split["__key__"] == ["k"]
    with pytest.raises(UsageError, match="4 rows of 4 tokens, more than rows_per_batch=2"):
        PackCollate(seq_len=4, pad_id=0, rows_per_batch=2)([doc])  # never cut silently
    cut = PackCollate(seq_len=4, pad_id=0, long_docs="truncate")([doc, np.array([9])])
    assert cut["input_ids"].tolist() == [[1, 2, 3, 4], [9, 0, 0, 0]]
    with pytest.raises(UsageError, match="long_docs='drop'"):
        PackCollate(seq_len=4, pad_id=0, long_docs="drop")([doc])


def test_pack_collate_errors():
    with pytest.raises(UsageError, match="pad_id"):
        PackCollate(seq_len=4, pad_id=None)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="more than rows_per_batch=1"):
        PackCollate(seq_len=4, pad_id=0, rows_per_batch=1)([np.arange(3), np.arange(3)])
    with pytest.raises(UsageError, match="no field 'tokens'"):
        PackCollate(seq_len=4, pad_id=0)([{"text": "x"}])
    with pytest.raises(UsageError, match="1-D integer"):
        PackCollate(seq_len=4, pad_id=0)([np.zeros(3, np.float32)])


def _unpack(out: dict, seq_len: int) -> list[list[int]]:
    """Segments of real tokens, read back through cu_seqlens, position_ids and labels."""
    flat_ids = out["input_ids"].reshape(-1)
    flat_pos = out["position_ids"].reshape(-1)
    flat_lab = out["labels"].reshape(-1)
    flat_mask = out["attention_mask"].reshape(-1)
    cu = out["cu_seqlens"].tolist()
    assert cu[0] == 0 and cu[-1] == flat_ids.numel() and all(b > a for a, b in pairwise(cu))
    assert out["max_seqlen"] == max(b - a for a, b in pairwise(cu))
    segments = []
    for a, b in pairwise(cu):
        assert a // seq_len == (b - 1) // seq_len  # a segment never crosses a row
        assert flat_pos[a:b].tolist() == list(range(b - a))  # positions restart per segment
        assert flat_lab[a] == IGNORE_INDEX  # no label across a boundary
        if flat_mask[a]:
            assert flat_mask[a:b].all()
            assert flat_lab[a + 1 : b].tolist() == flat_ids[a + 1 : b].tolist()
            segments.append(flat_ids[a:b].tolist())
        else:  # a row's padding run
            assert (b % seq_len == 0) and (flat_ids[a:b] == PAD).all()
            assert (flat_lab[a:b] == IGNORE_INDEX).all()
    return segments


@settings(deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=12), st.integers(1, 16))
def test_pack_collate_round_trip(lengths, seq_len):
    docs = [_tokens(n, i) + 0 for i, n in enumerate(lengths)]
    out = PackCollate(seq_len=seq_len, pad_id=PAD)(docs)
    assert out["input_ids"].shape[1] == seq_len
    rows = pack_rows(lengths, seq_len)
    assert out["input_ids"].shape[0] == len(rows)
    got = _unpack(out, seq_len)
    want = [docs[d][a:b].tolist() for row in rows for d, a, b in row if b > a]
    assert got == want
    assert sum(map(len, got)) == sum(lengths)  # no token lost or duplicated
    assert int(out["attention_mask"].sum()) == sum(lengths)


def _segment_samples(batch: np.ndarray, docs: dict) -> list[dict]:
    """What the dataset hands the collate for a segment batch: one sample per segment."""
    return [
        {"tokens": docs[i][a:b], "__index__": i, "__span__": (a, b)} for i, a, b in batch.tolist()
    ]


def test_pack_collate_from_planner_matches_the_plan():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 120, 300)  # many longer than seq_len
    planner = PackedBatches(seq_len=32, rows_per_batch=4, window=64)
    batches = planner.plan(rng.permutation(300), lengths, np.random.default_rng(0))
    collate = planner.make_collate(pad_id=PAD)
    docs = {i: _tokens(int(lengths[i]), i) for i in range(300)}
    got: dict[int, list[tuple[int, int]]] = {}
    for batch in batches:
        out = collate(_segment_samples(batch, docs))
        assert out["input_ids"].shape == (4, 32)  # always the planned shape, the tail too
        rows = pack_rows(batch[:, 2] - batch[:, 1], 32)
        want = [
            docs[i][a:b].tolist()
            for row in rows
            for i, a, b in (batch[d] for d, _, _ in row)
            if b > a
        ]
        assert _unpack(out, 32) == want  # the planned rows, segment for segment
        for i, span in zip(out["__index__"], out["__span__"], strict=True):
            got.setdefault(i, []).append(span)
    for i, spans in got.items():  # every token of every document, once
        covered = sorted(spans)
        assert covered[0][0] == 0 and covered[-1][1] == lengths[i]
        assert all(a[1] == b[0] for a, b in pairwise(covered))
    assert sorted(got) == list(range(300))


def test_collates_pickle_and_run_in_dataloader_workers():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, 64)
    docs = [_tokens(int(n), i) for i, n in enumerate(lengths)]
    planner = PackedBatches(seq_len=64, rows_per_batch=2, window=32)
    batches = planner.plan(np.arange(64), lengths, np.random.default_rng(1))
    collate = planner.make_collate(pad_id=PAD, field="tokens")
    assert pickle.loads(pickle.dumps(collate)) == collate
    assert pickle.loads(pickle.dumps(PadCollate({"a": 1}))) == PadCollate({"a": 1})
    dataset = [{"tokens": d} for d in docs]
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=[batch_ids(b).tolist() for b in batches],  # whole documents: all fit
        collate_fn=collate,
        num_workers=2,
        multiprocessing_context=multiprocessing.get_context("fork"),
    )
    for got, batch in zip(loader, batches, strict=True):
        want = collate([dataset[int(i)] for i in batch_ids(batch)])
        for key in ("input_ids", "labels", "position_ids", "cu_seqlens"):
            assert torch.equal(got[key], want[key])


def test_tokenizer_ids_round_trip_through_packing():
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    texts = ["the cat sat on the mat", "a dog ran", "shards stream into torch", "hello world"] * 5
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=60, special_tokens=["<pad>", "<unk>"])
    )
    pad_id = tok.token_to_id("<pad>")
    docs = [np.asarray(tok.encode(t).ids, np.uint16) for t in texts[:4]]
    out = PackCollate(seq_len=16, pad_id=pad_id)([{"tokens": d} for d in docs])
    decoded = [tok.decode(seg) for seg in _unpack_any(out)]
    assert decoded == [tok.decode(d.tolist()) for d in _first_fit_order(docs, 16)]
    assert {d.replace(" ", "") for d in decoded} == {t.replace(" ", "") for t in texts[:4]}


def _unpack_any(out: dict) -> list[list[int]]:
    cu = out["cu_seqlens"].tolist()
    ids, mask = out["input_ids"].reshape(-1), out["attention_mask"].reshape(-1)
    return [ids[a:b].tolist() for a, b in pairwise(cu) if mask[a]]


def _first_fit_order(docs: list[np.ndarray], seq_len: int) -> list[np.ndarray]:
    return [docs[d] for row in pack_rows([len(d) for d in docs], seq_len) for d, _, _ in row]


def test_torch_collate_keeps_what_default_collate_refuses_and_names_what_it_cannot_batch():
    from shardloader.batching.default import torch_collate

    day = [datetime.date(2024, 1, d) for d in (1, 2)]
    batch = torch_collate([{"day": d, "m": {"n": i, "at": d}} for i, d in enumerate(day)])
    assert batch["day"] == day and batch["m"]["at"] == day and batch["m"]["n"].tolist() == [0, 1]
    with pytest.raises(
        UsageError, match=r"field 'm.box': sample 0 holds a list of 2 and sample 1 one of 0"
    ):
        torch_collate([{"m": {"box": [0.5, 1.5]}}, {"m": {"box": []}}])
    # torch's own rule is kept where it does not fail: lists of one length are transposed
    assert torch_collate([{"tags": ["a"]}, {"tags": ["b"]}])["tags"] == [("a", "b")]


def test_torch_collate_names_a_sequence_field_of_unequal_lengths_and_the_padding_remedy():
    from shardloader.batching.default import torch_collate

    samples = [
        {"__key__": "doc-a", "input_ids": np.arange(5, dtype=np.uint16)},
        {"__key__": "doc-b", "input_ids": np.arange(7, dtype=np.uint16)},
    ]
    with pytest.raises(UsageError) as caught:
        torch_collate(samples)
    assert "field 'input_ids': sample 'doc-a' holds 5 values and sample 'doc-b' 7" in str(
        caught.value
    )
    assert "PadCollate(pad_values={'input_ids': ...})" in str(caught.value)
