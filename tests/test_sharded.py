"""SequenceSharded on one process (p = 1: the gather is a copy); the distributed behaviour is
in test_backend_distributed.py and the zoo."""

import torch

from ringcc.sharded import SequenceSharded, wrap_outputs


def sharded(local, front=0, back=0):
    return SequenceSharded(local, 1, "", 1, "contiguous", front, back)


def test_metadata_is_the_global_value_and_reading_needs_no_gather():
    x = sharded(torch.randn(2, 6, 3, requires_grad=True), front=0, back=1)
    assert x.shape == (2, 5, 3) and x.dtype == torch.float32 and x.requires_grad and x.dim() == 3
    assert x.numel() == 30 and len(x) == 2 and x.size(1) == 5
    assert not x._full  # metadata alone gathers nothing
    assert "SequenceSharded" in repr(x) and not x._full


def test_ops_read_the_window_and_gradients_reach_the_shard():
    local = torch.randn(2, 6, 3, requires_grad=True)
    x = sharded(local, front=1, back=0)
    w = torch.randn(2, 5, 3)
    assert isinstance(x[:, -1], torch.Tensor) and not isinstance(x[:, -1], SequenceSharded)
    torch.testing.assert_close(x[:, -1], local[:, -1])
    (x * w).sum().backward()
    want = torch.cat([torch.zeros(2, 1, 3), w], 1)
    torch.testing.assert_close(local.grad, want)
    assert x.full_tensor() is x.full_tensor()


def test_a_value_read_without_grad_is_gathered_again_with_grad():
    local = torch.randn(2, 4, requires_grad=True)
    x = sharded(local)
    with torch.no_grad():
        assert float(x.sum()) == float(local.sum())
    x.sum().backward()  # not cut off by the no_grad copy
    torch.testing.assert_close(local.grad, torch.ones(2, 4))


def test_wrap_outputs_wraps_only_the_listed_outputs():
    a, b = torch.randn(2, 4), torch.randn(())
    out = wrap_outputs((b, a), {1: (1, 0, 0, 1)}, "", 1, "contiguous")
    assert type(out) is tuple and out[0] is b and isinstance(out[1], SequenceSharded) and out[1].local is a


def test_batch_rows_merged_into_the_sequence_dim_keep_their_windows():
    """[b * n, ...] with b = 2 rows merged, each row's window [1, n): the gather narrows each."""
    local = torch.randn(2 * 6, 3, requires_grad=True)
    x = SequenceSharded(local, 0, "", 1, "contiguous", 1, 0, 2)
    assert x.shape == (10, 3) and x.positions().tolist() == [-1, 0, 1, 2, 3, 4] * 2
    torch.testing.assert_close(x.full_tensor(), local.view(2, 6, 3)[:, 1:].flatten(0, 1))


def test_a_function_that_records_the_wrapper_itself_sends_its_gradient_to_the_shard():
    """autograd.Function.apply records its inputs as they are (FSDP2's post-backward identity on a
    block's input): the wrapper's own gradient, of the global value, reaches this rank's rows."""

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad

    local = torch.randn(2, 6, 3, requires_grad=True)
    x = sharded(local * 1, front=1, back=0)
    assert not x.is_leaf and type(x.grad_fn).__name__ == "_FromLocalBackward" and not x._full
    y = Identity.apply(x)
    w = torch.randn(2, 5, 3)
    torch.testing.assert_close(y, local[:, 1:])
    (y * w).sum().backward()
    torch.testing.assert_close(local.grad, torch.cat([torch.zeros(2, 1, 3), w], 1))


CAUSAL_PADDING = "maskfn v1 tensors=1\n%0 = le kv q\n%1 = load t0 b kv\n%2 = and %0 %1\nreturn %2"


def test_a_mask_output_is_its_function_until_an_op_reads_it():
    """wrap_outputs puts a MaskFunctionOutput at a mask output's place (Note [Mask outputs]):
    the mask's metadata, and the dense mask eager code builds when an op reads it; the trailing
    tensors of the function are dropped from the outputs."""
    from ringcc.sharded import MaskFunctionOutput

    valid = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    x = torch.randn(2)
    out = wrap_outputs((x, torch.empty(0, dtype=torch.bool), valid), {}, "", 1, "contiguous",
                       (2, {1: (CAUSAL_PADDING, (2, 1, 5, 5), torch.bool, (2,))}))
    assert len(out) == 2 and out[0] is x
    mask = out[1]
    assert isinstance(mask, MaskFunctionOutput) and mask.shape == (2, 1, 5, 5) and mask.dtype == torch.bool
    assert mask._dense is None  # metadata alone builds nothing
    i = torch.arange(5)
    want = (i[None, None, :, None] >= i[None, None, None, :]) & valid[:, None, None, :]
    sliced = mask[:, :, :, :5]
    assert type(sliced) is torch.Tensor and torch.equal(sliced, want)
    assert mask.full_tensor() is mask.full_tensor()


def test_mask_from_fn_op_passes_opcheck():
    from ringcc.runtime.ops import mask_from_fn_op

    valid = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    torch.library.opcheck(mask_from_fn_op, (CAUSAL_PADDING, [2, 1, 3, 3], torch.bool, torch.device("cpu"), valid))
