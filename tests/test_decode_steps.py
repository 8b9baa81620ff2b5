"""The decode step's batch (epdserve.decode.steps.decode_batch): where each row's input id comes from (the step in
flight's samples, or the host), the positions and KV slots, against a plain reference built element by element."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from epdserve.decode.steps import Step, decode_batch
from epdserve.models.mrope import decode_positions

PAGE = 4


class _NoStates:
    def slots(self, keys):
        return None


def _seq(key: str, prompt_len: int, outputs: list[int], launched: int, row: int, delta: int, pages: list[int]):
    return SimpleNamespace(key=key, msg=SimpleNamespace(prompt_len=prompt_len), output_ids=outputs,
                           launched=launched, row=row, mrope_delta=delta, pages=pages)


def _reference_ids(seqs, prev):
    """Row b's newest token: the in-flight step's sample at its row, or its last output on the host."""
    return [int(prev.tokens[s.row]) if s.launched > len(s.output_ids) else s.output_ids[-1] for s in seqs]


def _batch(seqs, prev):
    return decode_batch(seqs, prev, SimpleNamespace(page_size=PAGE), _NoStates(), torch.device("cpu"))


def test_steady_state_takes_the_samples_as_they_are():
    prev = Step([], torch.tensor([11, 22, 33]))
    # every newest token is still in flight, rows in the previous step's order
    seqs = [_seq(f"r{b}", 5 + b, [7, 8], 3, b, 2 * b, [40 + b, 50 + b, 60 + b]) for b in range(3)]
    batch = _batch(seqs, prev)
    assert batch.input_ids.tolist() == _reference_ids(seqs, prev) == [11, 22, 33]
    assert batch.input_ids.data_ptr() == prev.tokens.data_ptr()  # no copy, no kernel
    idx = [s.msg.prompt_len + s.launched - 1 for s in seqs]
    assert torch.equal(batch.positions, decode_positions(torch.tensor(idx), torch.tensor([0, 2, 4])))
    assert batch.out_slots.tolist() == [s.pages[i // PAGE] * PAGE + i % PAGE for s, i in zip(seqs, idx)]
    assert batch.kv_lens == [i + 1 for i in idx] and batch.q_lens == [1, 1, 1]


def test_reordered_subset_and_mixed_rows():
    prev = Step([], torch.tensor([11, 22, 33, 44]))
    # a request finished: rows 3 and 1 remain, in another order (a gather of the samples)
    seqs = [_seq("a", 9, [1], 2, 3, 0, [0, 1, 2]), _seq("b", 4, [2], 2, 1, 1, [3, 4])]
    assert _batch(seqs, prev).input_ids.tolist() == _reference_ids(seqs, prev) == [44, 22]
    # a new request joins (its newest token on the host) beside two in flight
    seqs.append(_seq("c", 6, [5, 9], 2, -1, 0, [5, 6]))
    assert _batch(seqs, prev).input_ids.tolist() == _reference_ids(seqs, prev) == [44, 22, 9]
    # a prefix of the previous rows is a view too
    seqs = [_seq("d", 3, [1], 2, 0, 0, [7, 17]), _seq("e", 3, [1], 2, 1, 0, [8, 18])]
    assert _batch(seqs, prev).input_ids.tolist() == [11, 22]
    # nothing in flight: every id from the host
    seqs = [_seq("f", 3, [1, 6], 2, 0, 0, [9, 19])]
    assert _batch(seqs, None).input_ids.tolist() == [6] and _batch(seqs, prev).input_ids.tolist() == [6]
