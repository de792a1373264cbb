"""How a run is parallelised: data/ZeRO axes, batch placement, sequence and expert parallelism.

`plan.py` holds the one `ParallelPlan` of a run and the order its decisions are taken in;
`sequence_parallel.py` and `expert_parallel.py` implement the two parallelisms the bridge's
attention and grouped-GEMM lowerings run under it.
"""

from zerojax.parallel.expert_parallel import ExpertLoadLog, ExpertParallel
from zerojax.parallel.plan import ParallelPlan, make_parallel_plan
from zerojax.parallel.sequence_parallel import SequenceParallel

__all__ = [
    "ExpertLoadLog",
    "ExpertParallel",
    "ParallelPlan",
    "SequenceParallel",
    "make_parallel_plan",
]
