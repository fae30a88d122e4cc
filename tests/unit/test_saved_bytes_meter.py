"""SavedBytesMeter (mesh3d/planner/measure/meters.py): the bytes autograd keeps, as distinct storages, live and peak."""

import torch
from torch import nn

from mesh3d.planner.measure.meters import SavedBytesMeter


def test_a_storage_saved_twice_counts_once_parameters_not_at_all_and_backward_releases():
    meter = SavedBytesMeter()
    weight = nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        h = x * 2  # saves nothing of size (a constant)
        a = h @ weight  # saves h (4x8) and the parameter: the parameter is not counted
        b = h.sin()  # saves h again: already counted
        c = a.exp()  # saves its output (4x8)
        loss = (b + c).sum()
    assert meter.now == meter.peak == 2 * 4 * 8 * 4
    loss.backward()
    assert meter.now == 0 and meter.peak == 2 * 4 * 8 * 4


def test_a_view_counts_its_whole_storage_until_the_last_backward_using_it():
    meter = SavedBytesMeter()
    x = torch.randn(10, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        y = x.exp()  # saves its output, 10x8
        z = y[:2].sin()  # saves a view of y's storage: nothing new
    assert meter.now == 10 * 8 * 4
    (y.sum() + z.sum()).backward()
    assert meter.now == 0 and meter.peak == 10 * 8 * 4
