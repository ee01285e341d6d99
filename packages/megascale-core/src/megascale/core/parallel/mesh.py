"""ParallelDims: the sizes of each parallelism, validated, and the one named DeviceMesh they form.

Mesh dimensions, outermost first: ("dp", "pp", "cp", "tp").
- tp innermost: consecutive ranks — one node's GPUs on NVLink — form a tensor-parallel group, because TP
  communicates inside every layer (all-gather / reduce-scatter per block, forward and backward).
- cp next to it (Megatron's order too): context-parallel ranks exchange keys/values in every attention
  layer, so they come next closest; tp·cp ranks ideally fill one node.
- pp next: a pipeline (pp × tp ranks) is a contiguous block of ranks, i.e. whole nodes; stages exchange only
  activations between neighbours, point to point.
- dp outermost: data-parallel replicas communicate once per step (gradient reduction, overlapped with
  backward), which tolerates the slowest, inter-node links.
Rank r sits at (dp, pp, cp, tp) = (r // (pp·cp·tp), (r // (cp·tp)) % pp, (r // tp) % cp, r % tp). With cp = 1 the
mesh still has its "cp" dimension (of size 1), so code can always name it.

There is no module-level parallel state: the strategy builds one ParallelDims and passes its (sub-)meshes to
the ``apply_*`` functions explicitly.

The mesh also answers to the names Lightning's ModelParallelStrategy gives its dimensions ("data_parallel",
"tensor_parallel", and "pipeline_parallel"; "context_parallel" for cp), so a LightningModule written for that strategy
(``self.device_mesh["tensor_parallel"]``) runs unchanged: ``mesh["data_parallel"]`` is ``mesh["dp"]``, the
same sub-mesh and process group, not a copy.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["MESH_DIMS", "MESH_DIM_ALIASES", "ParallelDims"]

MESH_DIMS = ("dp", "pp", "cp", "tp")
MESH_DIM_ALIASES = {
    "data_parallel": "dp",
    "pipeline_parallel": "pp",
    "context_parallel": "cp",
    "tensor_parallel": "tp",
}
"""Lightning ModelParallelStrategy's dimension names, and the dimension each means here."""


class _MeshWithAliases(DeviceMesh):
    """A DeviceMesh that also answers to ``MESH_DIM_ALIASES`` (sub-meshes it returns are plain DeviceMeshes)."""

    def __getitem__(self, mesh_dim_names: str | tuple[str, ...]) -> DeviceMesh:
        if isinstance(mesh_dim_names, str):
            return super().__getitem__(MESH_DIM_ALIASES.get(mesh_dim_names, mesh_dim_names))
        return super().__getitem__(tuple(MESH_DIM_ALIASES.get(n, n) for n in mesh_dim_names))


@dataclass(frozen=True)
class ParallelDims:
    """Data-, pipeline-, context- and tensor-parallel sizes whose product is the world size."""

    dp: int
    pp: int
    tp: int
    cp: int = 1

    def __post_init__(self) -> None:
        for name in MESH_DIMS:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")

    @classmethod
    def infer(
        cls, world_size: int, *, tp: int = 1, pp: int = 1, cp: int = 1, dp: int | None = None
    ) -> ParallelDims:
        """Sizes for ``world_size`` ranks; ``dp`` defaults to world_size / (tp·pp·cp). Raises ValueError,
        naming the numbers and what to change, when they do not fit — before any process group exists."""
        for name, value in (("tp", tp), ("pp", pp), ("cp", cp), ("world size", world_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        replica = tp * pp * cp
        if world_size % replica:
            if cp == 1:
                fitting = [t for t in range(1, world_size + 1) if world_size % (t * pp) == 0]
                raise ValueError(
                    f"the world size {world_size} is not divisible by tp·pp = {tp}·{pp} = {tp * pp}: each "
                    f"data-parallel replica needs tp·pp ranks. With pp={pp}, tp can be one of {fitting}; or "
                    f"change the number of devices/nodes to a multiple of {tp * pp}."
                )
            fitting = [c for c in range(1, world_size + 1) if world_size % (tp * pp * c) == 0]
            raise ValueError(
                f"the world size {world_size} is not divisible by tp·pp·cp = {tp}·{pp}·{cp} = {replica}: each "
                f"data-parallel replica needs tp·pp·cp ranks. With tp={tp} and pp={pp}, cp can be one of "
                f"{fitting}; or change the number of devices/nodes to a multiple of {replica}."
            )
        inferred = world_size // replica
        if dp is not None and dp != inferred:
            cp_part = f" × cp={cp}" if cp > 1 else ""
            raise ValueError(
                f"dp={dp} × pp={pp}{cp_part} × tp={tp} = {dp * replica} does not match the world size "
                f"{world_size}; leave dp unset to infer it ({inferred})"
            )
        return cls(dp=inferred, pp=pp, tp=tp, cp=cp)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The mesh's sizes in ``MESH_DIMS`` order: (dp, pp, cp, tp)."""
        return (self.dp, self.pp, self.cp, self.tp)

    def coordinates(self, rank: int) -> dict[str, int]:
        """(dp, pp, cp, tp) position of a global rank."""
        return {
            "dp": rank // (self.pp * self.cp * self.tp),
            "pp": (rank // (self.cp * self.tp)) % self.pp,
            "cp": (rank // self.tp) % self.cp,
            "tp": rank % self.tp,
        }

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The 4-D mesh named ("dp", "pp", "cp", "tp") over the default process group (also indexable by
        ``MESH_DIM_ALIASES``)."""
        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIMS)
        # the class is swapped rather than the mesh re-created: the same process groups, no new ones
        mesh.__class__ = _MeshWithAliases
        return mesh
