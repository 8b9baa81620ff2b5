"""Decode CUDA graphs: replayed steps give the same greedy tokens as eager steps (GPU only; skipped on CPU).

Models: the ``gpu_model`` fixture (conftest.py): the small checkpoints and a shallow copy of each preset.
"""

from __future__ import annotations


import pytest
import torch

from epdserve.engine.cuda_graph import graph_batch_sizes
from epdserve.engine.forward_batch import ForwardBatch
from epdserve.kvcache.page_pool import PagePool
from epdserve.engine.model_runner import ModelRunner
from epdserve.models.mrope import decode_positions

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = graph_batch_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256
    assert all(b - a <= 8 for a, b in zip(sizes, sizes[1:]))
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def greedy(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Prefill ``prompts`` in one eager forward, then ``steps`` greedy decode steps for all of them at once."""
    ps = runner.page_size
    pool = PagePool(runner.num_pages, ps)
    pages = [pool.alloc(pool.pages_for(len(p) + steps)) for p in prompts]
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts]).expand(3, -1)
    slots = torch.tensor([s for p, pg in zip(prompts, pages) for s in pool.slots(pg, 0, len(p))])
    lens = [len(p) for p in prompts]
    logits = runner.forward(ForwardBatch(False, ids, positions, slots, lens, lens, pages))
    out = [[t] for t in logits.argmax(-1).tolist()]
    for _ in range(steps - 1):
        idx = [len(p) + len(o) - 1 for p, o in zip(prompts, out)]
        batch = ForwardBatch(True, torch.tensor([o[-1] for o in out]),
                             decode_positions(torch.tensor(idx), torch.zeros(len(idx), dtype=torch.int64)),
                             torch.tensor([pool.slots(pg, i, i + 1)[0] for pg, i in zip(pages, idx)]),
                             [1] * len(idx), [i + 1 for i in idx], pages)
        for o, t in zip(out, runner.forward(batch).argmax(-1).tolist()):
            o.append(t)
    return out


def overlapped(runner: ModelRunner, eager: ModelRunner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy outputs through the decode server's scheduler (overlap on, ``runner``'s CUDA graphs), from prompt KV
    that ``eager`` prefilled and hands over as :class:`KVTransfer` s."""
    from epdserve.decode.scheduler import DecodeScheduler
    from epdserve.wire.messages import DecodeRequest, KVTransfer, SamplingParams

    ps = eager.page_size
    pool = PagePool(eager.num_pages, ps)
    pages = [pool.alloc(pool.pages_for(len(p))) for p in prompts]
    slots = [pool.slots(pg, 0, len(p)) for p, pg in zip(prompts, pages)]
    lens = [len(p) for p in prompts]
    logits = eager.forward(ForwardBatch(False, torch.tensor([t for p in prompts for t in p]),
                                        torch.cat([torch.arange(n) for n in lens]).expand(3, -1),
                                        torch.tensor([s for sl in slots for s in sl]), lens, lens, pages))
    sched = DecodeScheduler(runner, context_length=4096, max_running_requests=len(prompts), timeout_s=60,
                            kv_endpoint="tcp://x")
    for i, (n, first) in enumerate(zip(lens, logits.argmax(-1).tolist())):
        sched.add_request(DecodeRequest(rid=str(i), prompt_len=n, sampling=SamplingParams(
            temperature=0, max_new_tokens=steps, ignore_eos=True), bootstrap_host="h", bootstrap_port=1,
            bootstrap_room=i), peer=b"g")
        sched.add_transfer(KVTransfer(rid=str(i), bootstrap_room=i, first_token_id=first,
                                      kv=eager.read_kv(torch.tensor(slots[i]))))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while sched.has_work():
        for _, o in sched.step():
            out[o.rid] += o.token_ids
    assert sched.pool.num_free == sched.pool.num_pages
    return [out[str(i)] for i in range(len(prompts))]


@pytest.mark.gpu
@needs_cuda
def test_graph_and_overlapped_decode_match_eager(gpu_model):
    """64 greedy tokens at batch 1, 5 and 16 (prompts of 5 .. 299 tokens): graph replays equal eager steps, and so
    does the decode scheduler (overlap on) over the graphs. Graphs are captured for batch sizes 1, 2, 4, 8, 16:
    batches 1 and 16 replay a graph of their own size, batch 5 one of 8 with three padding rows."""
    pytest.importorskip("flashinfer")
    kw = dict(device=torch.device("cuda"), dtype=torch.bfloat16, num_pages=2048, page_size=16)
    eager = ModelRunner(gpu_model, **kw)
    graphed = ModelRunner(gpu_model, cuda_graph_max_bs=16, **kw)
    assert eager.graphs is None and graphed.graphs is not None
    gen = torch.Generator().manual_seed(0)
    vocab = min(eager.config.vocab_size, 1000)  # the small checkpoint's tokenizer has fewer than 1000 ids
    for n in (1, 5, 16):
        prompts = [torch.randint(10, vocab, (int(L),), generator=gen).tolist()
                   for L in torch.randint(5, 300, (n,), generator=gen)]
        want = greedy(eager, prompts, 64)
        assert greedy(graphed, prompts, 64) == want, f"batch {n}: graph replay diverged from eager"
        assert overlapped(graphed, eager, prompts, 64) == want, f"batch {n}: overlap diverged"
    print(f"{eager.config.num_layers} layers: 64 greedy tokens at batch 1, 5, 16 equal for eager, graph replay "
          "and overlapped graph decode")


def test_overlapped_decode_matches_step_by_step_on_cpu(tiny_model_path):
    """The overlap scheduler (inputs taken from the previous step's samples, results read one step late) gives
    the tokens of plain step-by-step greedy decoding, for requests of different lengths in one batch."""
    runner = ModelRunner(tiny_model_path, device=torch.device("cpu"), dtype=torch.float32, num_pages=512,
                         page_size=16)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(10, runner.config.vocab_size, (n,), generator=gen).tolist() for n in (3, 40, 17)]
    assert overlapped(runner, runner, prompts, 24) == greedy(runner, prompts, 24)


@pytest.mark.gpu
@needs_cuda
def test_extends_of_one_and_several_tokens_match_one_shot_prefill(gpu_model):
    """A prompt prefilled at once against the same prompt as a prefill and then an extend of 1 token (the one-row
    path, whose layers hand split-K parts to the next norm) or of 7 (the several-row path's parts): the last
    token's log-probabilities within 0.5 nats of the one-shot's for its top token and the extend's own, so each
    greedy choice is the one-shot's or a near-tie of it. Summing only some parts (a lost split-K part) moves the
    hidden state by a whole MLP's output and breaks this."""
    runner = ModelRunner(gpu_model, device=torch.device("cuda"), dtype=torch.bfloat16, num_pages=64,
                         page_size=16, cuda_graph_max_bs=0)
    ps, gen = runner.page_size, torch.Generator().manual_seed(5)
    vocab = min(runner.config.vocab_size, 1000)  # the small checkpoint's tokenizer has fewer than 1000 ids
    for n in (40, 57, 90):
        prompt = torch.randint(10, vocab, (n,), generator=gen)
        pool = PagePool(runner.num_pages, ps)

        def prefill(start: int, pages) -> torch.Tensor:
            ids, pos = prompt[start:], torch.arange(start, n).expand(3, -1)
            return runner.forward(ForwardBatch(False, ids, pos, torch.tensor(pool.slots(pages, start, n)),
                                               [n - start], [n], [pages])).float().log_softmax(-1)[0]

        pages = pool.alloc(pool.pages_for(n))
        one_shot = prefill(0, pages)
        for new in (1, 7):
            pages = pool.alloc(pool.pages_for(n))
            ids, pos = prompt[:n - new], torch.arange(n - new).expand(3, -1)
            runner.forward(ForwardBatch(False, ids, pos, torch.tensor(pool.slots(pages, 0, n - new)), [n - new],
                                        [n - new], [pages]))
            got = prefill(n - new, pages)
            for token in {int(one_shot.argmax()), int(got.argmax())}:
                assert abs(float(got[token] - one_shot[token])) < 0.5 and \
                    float(one_shot.max() - one_shot[token]) < 0.5, (n, new, token)
