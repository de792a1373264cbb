"""zerojax.compat.torch_export on the torch this venv holds: torch 2.13 in `make test`, 2.11 in
`make test-torch-2.11` and `make test-gpu-stack`, 2.14 in `make test-torch-2.14`, so each
branch runs somewhere.

    .venv/bin/python -m pytest -q tests/compat/test_torch_export.py
"""

import pytest
import torch
from torch import nn

from zerojax.compat import torch_export

TORCH_2_12 = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 12)


def test_the_serializer_form_is_chosen_for_this_torch():
    """torch 2.12 added the keywords that leave the weights out; 2.11 always writes them."""
    assert torch_export._serializer_takes_parts() == TORCH_2_12


def test_a_program_serializes_without_the_bytes_of_its_weights():
    """The entry holds the graph, not the 4 MB of weights: on torch 2.11 too, where the
    serializer has no switch for them; the serialized graph still names every weight."""
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))
    program = torch.export.export(model, (torch.randn(4, 512),))
    weight_bytes = sum(t.numel() * t.element_size() for t in program.state_dict.values())
    assert weight_bytes > 4 * 2**20
    serialized = torch_export.serialize_without_weights(program)
    assert len(serialized.state_dict) + len(serialized.example_inputs) < weight_bytes / 100
    signature = serialized.exported_program.graph_module.signature
    targets = {
        spec.value.parameter_name for spec in signature.input_specs if spec.type == "parameter"
    }
    assert targets == set(program.state_dict)
    # The program itself is left as it was.
    assert all(t.device.type == "cpu" for t in program.state_dict.values())
    assert program.example_inputs is not None


def test_exporting_leaves_torch_as_it_found_it():
    """Under torch 2.11 the tensor check is a no-op only while torch.export traces (a model run
    eagerly afterwards still raises); on later torch nothing is touched."""
    check_tensor_all = torch._check_tensor_all
    with torch_export.exporting():
        assert (torch._check_tensor_all is check_tensor_all) == torch_export.TORCH_2_12
    assert torch._check_tensor_all is check_tensor_all
    with pytest.raises(RuntimeError):
        torch._check_tensor_all(torch.tensor([True, False]))
