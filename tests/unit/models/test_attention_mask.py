"""block_causal attention: a packed batch is the same as its documents run one by one, the two kernels'
masks agree (also for a subset of the queries, as a context-parallel rank holds), and the mask is built
once per batch outside compiled blocks and activation checkpoints."""

from __future__ import annotations

import json
import warnings
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from builders import config, loader
from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

from titanlite.config import ActivationCheckpoint
from titanlite.data.batch import Batch
from titanlite.data.tokenizer import build_tokenizer
from titanlite.errors import ConfigError
from titanlite.models.common import attention, kv_cache
from titanlite.models.common import dense_activations as activations
from titanlite.models.common.attention import block_mask, build_mask, dense_mask, document_ids, mask_bytes, mask_mod
from titanlite.models.llama3.model import ModelArgs, Transformer
from titanlite.models.llama3.rope import rope_at, rope_tables
from titanlite.parallelisms.activation_checkpoint import apply_ac
from titanlite.parallelisms.context_parallel.unit import SEAM, SequenceShard
from titanlite.parallelisms.layout import Layout
from titanlite.parallelisms.parallel_dims import ParallelDims
from titanlite.parallelisms.step_context import StepContext
from titanlite.planning.run_plan import RunPlan
from titanlite.run.step import LocalRunner, cross_entropy_loss, model_forward

TOK = build_tokenizer(None)
SEQ = 48
ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=TOK.n_words, max_seq_len=SEQ)


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    """Two rows of the real loader over short documents: several documents per row, and a row that
    begins inside a document (its positions do not start at 0)."""
    path = tmp_path_factory.mktemp("docs") / "docs.jsonl"
    docs = [f"doc {i} " + "word " * (3 + 5 * (i % 4)) for i in range(8)]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    it = iter(loader(path, gbs=2, lbs=2, seq_len=SEQ, shards=1))
    next(it)
    b = next(it)
    assert b.positions[0, 0] > 0 and (b.positions == 0).sum(-1).min() >= 2
    return b


def model() -> Transformer:
    m = Transformer(ARGS, seq_len=SEQ)
    m.init_weights(seed=0)
    return m


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none").view(labels.shape)


def segments(positions: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each document in a row: a document starts where its position is 0."""
    starts = [0] + [i for i, p in enumerate(positions) if p == 0 and i > 0]
    return list(zip(starts, starts[1:] + [len(positions)]))


def test_packed_documents_equal_each_document_alone(batch):
    """Per token (hence per document), the packed block_causal batch gives each document's loss run on
    its own (fp32, <= 1e-5); `causal` attends across documents and differs. The runner's loss is their mean."""
    torch.manual_seed(0)
    m = model()
    with torch.no_grad():
        packed = token_losses(model_forward(m, batch, "block_causal"), batch.labels)
        across = token_losses(model_forward(m, batch, "causal"), batch.labels)
        alone = torch.empty_like(packed)
        for row in range(batch.inputs.shape[0]):
            for start, end in segments(batch.positions[row].tolist()):
                tokens = batch.inputs[row : row + 1, start:end]
                # The document alone, causal; a row's first document may continue one begun earlier.
                positions = batch.positions[row : row + 1, start:end]
                logits = m(tokens) if positions[0, 0] == 0 else m(tokens, positions=positions)
                alone[row, start:end] = token_losses(logits, batch.labels[row : row + 1, start:end])[0]
    assert (packed - alone).abs().max() <= 1e-5
    # Negative control: causal lets the documents after a row's first one see the earlier ones.
    first_ends = [segments(batch.positions[r].tolist())[0][1] for r in range(2)]
    assert min((across[r, e:] - alone[r, e:]).abs().max() for r, e in enumerate(first_ends)) > 1e-3
    runner = LocalRunner(m, torch.device("cpu"), StepContext(cross_entropy_loss), "block_causal")
    with torch.no_grad():
        assert runner.evaluate(batch).item() == pytest.approx(alone.mean().item(), abs=1e-5)


def test_rope_at_positions_is_the_table_bitwise():
    cos, sin = rope_tables(ARGS, SEQ)
    pos = torch.arange(SEQ).expand(3, SEQ)
    at_cos, at_sin = rope_at(ARGS, pos)
    assert torch.equal(at_cos[1], cos) and torch.equal(at_sin[2], sin)


def test_dense_and_flex_masks_agree_also_for_a_query_subset(batch):
    """The mask_mod flex attention evaluates (through its own vmap, on CPU index tensors) equals the
    dense mask, for every query and for a head-tail subset of them (two chunks: what a context-parallel
    rank holds) with every key; the subset's rows are the full mask's rows."""
    doc = document_ids(batch.positions)
    full = torch.arange(SEQ)
    q_sub = torch.cat([full[:6], full[-6:]])
    dense_full = dense_mask(doc, full, full)
    for q in (full, q_sub):
        flex = create_mask(mask_mod(doc, q, full), doc.shape[0], 1, len(q), SEQ, device="cpu")
        dense = dense_mask(doc, q, full)
        assert torch.equal(flex, dense) and torch.equal(dense, dense_full[:, :, q])
    # Spot check of the definition: a token attends only itself and earlier tokens of its document.
    row = batch.positions[0].tolist()
    for start, end in segments(row):
        for i in range(start, end):
            assert dense_full[0, 0, i].nonzero().flatten().tolist() == list(range(start, i + 1))
    assert build_mask("causal", batch.positions) is None
    assert torch.equal(build_mask("block_causal", batch.positions), dense_full)  # CPU: dense


def test_flex_attention_with_the_block_mask_equals_masked_sdpa(batch):
    """The CUDA kernel's inputs, checked on CPU forward (flex attention has no CPU backward): a BlockMask
    from the same mask_mod gives masked SDPA's output, with grouped-query heads."""
    doc, idx = document_ids(batch.positions), torch.arange(SEQ)
    block = create_block_mask(mask_mod(doc, idx, idx), 2, None, SEQ, SEQ, device="cpu", BLOCK_SIZE=16)
    q, k, v = torch.randn(2, 4, SEQ, 8), torch.randn(2, 2, SEQ, 8), torch.randn(2, 2, SEQ, 8)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # uncompiled flex attention warns that it is unfused
        flex = flex_attention(q, k, v, block_mask=block, enable_gqa=True)
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(doc, idx, idx), enable_gqa=True)
    assert (flex - dense).abs().max() < 1e-5


@pytest.mark.parametrize("ac", [ActivationCheckpoint("full"), ActivationCheckpoint("selective", "op")])
def test_activation_checkpointing_and_compiled_blocks_keep_the_mask(batch, ac):
    """Gradients under activation checkpointing equal the plain model's; compiled blocks (Dynamo with a
    counting backend) trace once and are not recompiled by later batches' masks and positions."""
    from torch._dynamo.testing import CompileCounter

    def grads(m):
        m.zero_grad()
        model_forward(m, batch, "block_causal").float().square().mean().backward()
        return [p.grad.clone() for p in m.parameters()]

    plain, checkpointed = model(), model()
    apply_ac({f"layers.{k}": b for k, b in checkpointed.layers.items()}, ac)
    for a, b in zip(grads(plain), grads(checkpointed)):
        assert torch.allclose(a, b, atol=1e-6)

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = model()
    for block in compiled.layers.values():
        block.forward = torch.compile(block.forward, backend=counter, fullgraph=True)
    rolled = batch._replace(positions=batch.positions.roll(5, dims=-1))  # other documents, same shapes
    model_forward(compiled, batch, "block_causal").sum().backward()
    traced = counter.frame_count
    model_forward(compiled, rolled, "block_causal").sum().backward()
    model_forward(compiled, batch, "block_causal").sum().backward()
    assert traced >= 1 and counter.frame_count == traced


def test_the_memory_estimate_counts_the_mask():
    one = ParallelDims(1, 1, 1, 1)
    layout = Layout(one, None, "simple_fsdp", torch.float32, torch.float32, "default", False, "none", "op", 2, 4096)
    causal = activations.activation_bytes(ARGS, layout)
    for device, expected in (("cpu", 2 * 4096 * 4096), ("cuda", mask_bytes("block_causal", "cuda", 2, 4096, 4096))):
        masked = activations.activation_bytes(ARGS, replace(layout, attn_mask="block_causal", device_type=device))
        assert masked["attention mask"] == expected and masked["peak"] == causal["peak"] + expected
    # A BlockMask: int32 counts and indices of 32 x 32 tiles of 128, both orientations, partial and full.
    assert mask_bytes("block_causal", "cuda", 2, 4096, 4096) == 2 * 4 * 2 * (2 * 32 + 2 * 32 * 32)
    assert "attention mask" not in causal


class FlexMask:
    """What `block_mask` builds on CUDA, stood in for on the CPU: the dense mask it equals, marked."""

    def __init__(self, dense: torch.Tensor):
        self.dense = dense


def test_a_pipeline_stage_under_context_parallelism_attends_with_the_steps_mask_flex_on_cuda(monkeypatch):
    """A pipeline stage under context parallelism gets hidden states only (no positions, no mask): it
    builds its queries' causal mask once per microbatch, as the step does without stages, so on CUDA every
    block attends through flex attention's BlockMask, never SDPA with a dense [S/cp, S] mask, which with
    grouped-query heads runs the math kernel (every score materialised: ~128 GiB per layer at 405B, cp 4,
    128k). CUDA is simulated at the device choice (`uses_flex`) with a marked stand-in for the BlockMask;
    the keys and values a second cp rank would send are this rank's again (`start_gather` and
    `finish_gather`, one process). The stage's output equals the step's path (`model_forward` with the
    shard as the step context's hook), bitwise."""
    torch.manual_seed(0)
    model = Transformer(ARGS, seq_len=SEQ)
    model.init_weights(seed=0)
    shard = SequenceShard(degree=2, rank=1, group_name="unused")
    for module in model.modules():
        if hasattr(type(module), SEAM):
            setattr(module, SEAM, shard)
    monkeypatch.setattr(SequenceShard, "start_gather", lambda self, t, dim: t)
    monkeypatch.setattr(SequenceShard, "finish_gather", lambda self, t, dim: torch.cat([t, t], dim=dim))
    monkeypatch.setattr(attention, "uses_flex", lambda device_type: True)
    monkeypatch.setattr(attention, "block_mask", lambda *ids: FlexMask(dense_mask(*ids)))
    masks, attend = [], kv_cache.attend

    def recording_attend(q, k, v, mask, causal=True, scale=None):
        masks.append(mask)
        return attend(q, k, v, mask.dense if isinstance(mask, FlexMask) else mask, causal, scale)

    monkeypatch.setattr(kv_cache, "attend", recording_attend)
    tokens = torch.randint(0, ARGS.vocab_size, (2, SEQ))
    stage = model(shard.shard(tokens))  # the first stage of a pipeline: the schedule hands tokens alone
    assert len(masks) == ARGS.n_layers and all(isinstance(m, FlexMask) for m in masks), masks
    held = shard.positions(SEQ // 2, tokens.device)
    assert torch.equal(masks[0].dense[0, 0], held[:, None] >= torch.arange(SEQ)[None, :])
    step = model_forward(model, Batch(tokens, tokens, None), "causal", StepContext(cross_entropy_loss, hooks=(shard,)))
    assert torch.equal(stage, step)


def test_block_causal_under_pipeline_parallelism_is_refused(tmp_path):
    cfg = config(tmp_path, model__attn_mask_type="block_causal", parallelism__pipeline_parallel_degree=2)
    with pytest.raises(ConfigError, match="attn_mask_type block_causal is not supported with pipeline"):
        RunPlan.build(cfg, 2)


@pytest.mark.slow
def test_the_compiled_block_mask_is_the_uncompiled_one_without_recompiling():
    """`block_mask` (what build_mask runs on CUDA; compiled, here on CPU) gives create_block_mask's own
    result for a full row and a head-tail query subset, and later batches' documents reuse its compiled
    code (about 5 s: one inductor compile)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    seq, idx = 512, torch.arange(512)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        cuts = torch.zeros(2, seq, dtype=torch.long).bernoulli_(0.02, generator=g).bool()
        positions = torch.arange(seq).expand(2, seq) - torch.cummax(torch.where(cuts, idx, 0), -1).values
        doc = document_ids(positions)
        for q in (idx, torch.cat([idx[:128], idx[-128:]])):
            got = block_mask(doc, q, idx)
            want = create_block_mask(mask_mod(doc, q, idx), 2, None, len(q), seq, device="cpu")
            assert torch.equal(got.to_dense(), want.to_dense())
        if seed == 0:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs
