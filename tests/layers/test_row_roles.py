"""layers/row_roles.py: which rows of a batch compute prompt tokens, and a layer's rows split by
that role and put back in their places, exactly."""

from __future__ import annotations

import torch

from tokenloom.layers import row_roles


def test_prompt_rows_index_each_role_in_row_order():
    # sequence 0: 3 rows, 2 in its prompt; sequence 1: a decode row; sequence 2: 2 prompt rows
    rows = row_roles.prompt_rows([3, 1, 2], [2, 0, 2])
    assert rows is not None and rows.num_rows == 6
    assert rows.prompt_index.tolist() == [0, 1, 4, 5]
    assert rows.other_index.tolist() == [2, 3]
    everything = row_roles.prompt_rows([3, 2], [3, 2])
    assert everything == row_roles.PromptRows(5)
    assert row_roles.prompt_rows([1, 1], [0, 0]) is None
    assert row_roles.prompt_rows([3], None) is None


def test_split_by_role_puts_each_result_back_in_its_row():
    x = torch.arange(12, dtype=torch.float32).view(6, 2)

    def other(rows):
        return rows.sum(dim=1, keepdim=True).repeat(1, 3)

    def prompt(rows):
        return -rows.sum(dim=1, keepdim=True).repeat(1, 3)

    sums = x.sum(dim=1)
    with row_roles.computing([3, 1, 2], [2, 0, 2]):
        out = row_roles.split_by_role(x, other, prompt)
        signs = torch.tensor([-1.0, -1.0, 1.0, 1.0, -1.0, -1.0])
        assert torch.equal(out, (signs * sums).unsqueeze(1).repeat(1, 3))
        # rows that are not the batch's (an LM head's selected rows) all take the other path
        assert torch.equal(row_roles.split_by_role(x[:2], other, prompt), other(x[:2]))
        # no prompt kernel: every row the other path
        assert torch.equal(row_roles.split_by_role(x, other, None), other(x))
    with row_roles.computing([6], [6]):
        assert torch.equal(row_roles.split_by_role(x, other, prompt), prompt(x))
    # outside a batch, and after one: the other path
    assert torch.equal(row_roles.split_by_role(x, other, prompt), other(x))
