"""The device mesh: ``MeshLayout`` (pure arithmetic) and ``ProcessMesh`` (real groups).

Every group comes from one named grid built with one idiom,
``torch.arange(world).view(shape)``, whose axes are named once, slowest first:
``pp``, ``dp``, ``sp``, ``tp``. So ``tp`` varies fastest::

    rank = ((pp_i * dp + dp_i) * sp + sp_i) * tp + tp_i

Worked example, ``ParallelConfig(dp=2, pp=2, tp=2)`` (8 ranks)::

    rank  pp dp sp tp      groups("tp") = [[0,1],[2,3],[4,5],[6,7]]
      0    0  0  0  0      groups("dp") = [[0,2],[1,3],[4,6],[5,7]]
      1    0  0  0  1      groups("pp") = [[0,4],[1,5],[2,6],[3,7]]
      2    0  1  0  0
      3    0  1  0  1      rank 5 sees: tp group [4,5] (tp rank 1),
      4    1  0  0  0               dp group [5,7] (dp rank 0),
      5    1  0  0  1               pp group [1,5] (last stage).
      ...

A group on an axis is the set of ranks whose coordinates differ on that axis
only. The tensor block of ``tp`` consecutive ranks is itself a small grid
whose sub-axes depend on ``tp_mode`` (last name fastest):

=========  ===============================  =======================================
tp_mode    sub-axes (sizes)                 tp_i from sub-coordinates
=========  ===============================  =======================================
``1d``     ``tp`` (P)                       tp_i
``2d``     ``tp_row``, ``tp_col`` (q, q)    row * q + col
``2.5d``   ``tp_dep``, ``tp_row``,          (dep * q + row) * q + col: each depth
           ``tp_col`` (d, q, q)             layer is one contiguous q x q SUMMA grid
``3d``     ``tp_in``, ``tp_wt``,            (in * q + wt) * q + out
           ``tp_out`` (q, q, q)
=========  ===============================  =======================================

Worked example, 2D with tp=4 (q=2), ranks 0..3 of one tensor block::

    grid        coords                     groups("tp_col") = [[0,1],[2,3]]   (one grid row each)
    0 1         0: row 0 col 0             groups("tp_row") = [[0,2],[1,3]]   (one grid column each)
    2 3         3: row 1 col 1

In SUMMA, rank (i, j) holds block A[i, j]; the broadcast of A[i, k] runs over
its ``tp_col`` group (its grid row), that of B[k, j] over its ``tp_row`` group.

Expert parallelism (``ep > 1``) adds two axes folded over the ``dp x sp`` ranks of each (pp, tp)
position, numbered ``f = dp_i * sp + sp_i``: ``ep`` (fastest, ``ep_i = f % ep``) splits the experts,
``edp`` (``edp_i = f // ep``) holds the same experts on other tokens. Worked example,
``ParallelConfig(dp=4, ep=2)``::

    rank  dp  edp ep      groups("ep")  = [[0,1],[2,3]]   (tokens exchanged by all-to-all)
      0    0   0   0      groups("edp") = [[0,2],[1,3]]   (expert gradients summed)
      1    1   0   1
      2    2   1   0      rank 2 holds experts 0..E/2-1 of every MoE layer, as rank 0 does
      3    3   1   1

``dp_sp`` is the same ``dp x sp`` block flattened (``f`` as above): the ranks that hold the same weights,
over which data parallelism reduces and ZeRO shards (``ParallelConfig.zero_ranks``). With ``sp = 1`` its groups
are dp's, with ``dp = 1`` sp's. ``ParallelConfig(dp=2, sp=2, tp=2)``: ``groups("dp_sp") = [[0, 2, 4, 6],
[1, 3, 5, 7]]``, rank 6 at ``dp_sp`` coordinate 3.
"""
from __future__ import annotations

import threading

import gc
import weakref
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .config import Axis, AXES, ParallelConfig
from .comm import CommLog
from .comm.waiting import QUEUED_COMPLETES

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MeshLayout", "ProcessMesh", "tp_sub_axes"]


def _names(*axes: str) -> tuple[str, ...]:
    """Axis names as plain ``str`` for torch's DeviceMesh (``Axis`` members are ``str`` already; torch gets
    exactly the type it documents)."""
    return tuple(str(a) for a in axes)


def tp_sub_axes(cfg: ParallelConfig) -> dict[str, int]:
    """Names and sizes of the tensor block's sub-axes, slowest first (see module docstring)."""
    q = cfg.tp_q
    if cfg.tp_mode == "2d":
        return {Axis.TP_ROW: q, Axis.TP_COL: q}
    if cfg.tp_mode == "2.5d":
        return {Axis.TP_DEP: cfg.tp_depth, Axis.TP_ROW: q, Axis.TP_COL: q}
    if cfg.tp_mode == "3d":
        return {Axis.TP_IN: q, Axis.TP_WT: q, Axis.TP_OUT: q}
    return {}


class MeshLayout:
    """Rank <-> coordinates and group membership for every axis; no processes.

    >>> lay = MeshLayout(ParallelConfig(dp=2, tp=2))
    >>> lay.coords(3)
    {'pp': 0, 'dp': 1, 'sp': 0, 'tp': 1}
    >>> lay.groups("dp")
    [[0, 2], [1, 3]]
    """

    def __init__(self, config: ParallelConfig):
        self.config = config
        self.sub = tp_sub_axes(config)
        self.axes = tuple(AXES) + tuple(self.sub)
        shape = [config.pp, config.dp, config.sp, config.tp]
        self.grid = torch.arange(config.world_size).view(*shape)
        self.fine_names = (Axis.PP, Axis.DP, Axis.SP) + (tuple(self.sub) or (Axis.TP,))
        self.fine_grid = self.grid.view(*shape[:3], *(self.sub.values() or [config.tp]))
        self.ep = getattr(config, "ep", 1)
        if self.ep > 1:  # [pp, edp, ep, tp]: the dp x sp block folded, ep fastest
            self.axes += (Axis.EDP, Axis.EP)
            self.expert_grid = self.grid.reshape(config.pp, config.dp * config.sp // self.ep, self.ep, config.tp)

    @property
    def world_size(self) -> int:
        return self.config.world_size

    def size(self, axis: str) -> int:
        """Number of ranks in each group of ``axis``."""
        self._check_axis(axis)
        if axis == Axis.DP_SP:
            return self.config.zero_ranks
        if axis in (Axis.EP, Axis.EDP):
            return self.ep if axis == Axis.EP else self.config.dp * self.config.sp // self.ep
        return self.config.shape[axis] if axis in AXES else self.sub[axis]

    def coords(self, rank: int) -> dict[str, int]:
        """``{"pp", "dp", "sp", "tp"}`` coordinates of ``rank``."""
        self._check_rank(rank)
        idx = (self.grid == rank).nonzero()[0].tolist()
        return dict(zip(AXES, idx))

    def sub_coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` on the tensor sub-axes of its mode (empty for 1d)."""
        self._check_rank(rank)
        if not self.sub:
            return {}
        idx = (self.fine_grid == rank).nonzero()[0].tolist()[3:]
        return dict(zip(self.sub, idx))

    def all_coords(self, rank: int) -> dict[str, int]:
        """Main and tensor sub-axis coordinates together (and ``edp``, ``ep`` with experts split; ``dp_sp``, the
        ``dp x sp`` block flattened, is left out of tables: ``ProcessMesh.rank`` answers it)."""
        out = {**self.coords(rank), **self.sub_coords(rank)}
        if self.ep > 1:
            folded = self.dp_sp(out)
            out.update({Axis.EDP: folded // self.ep, Axis.EP: folded % self.ep})
        return out

    def dp_sp(self, coords: dict[str, int]) -> int:
        """The ``dp_sp`` coordinate of a rank at ``coords``: its place in the ``dp x sp`` block flattened, sp
        fastest (the fold ep and ``edp`` split too)."""
        return coords[Axis.DP] * self.config.sp + coords[Axis.SP]

    def rank_of(self, **coords: int) -> int:
        """Inverse of ``coords``: ``rank_of(pp=1, dp=0, sp=0, tp=1)``; missing axes count as 0."""
        for axis, i in coords.items():
            if axis not in AXES:
                raise ValueError(f"unknown axis {axis!r} for rank_of: give coordinates on {', '.join(AXES)}")
            if not 0 <= i < self.config.shape[axis]:
                raise ValueError(f"{axis}={i} is outside the {axis} axis of size {self.config.shape[axis]}")
        idx = tuple(coords.get(a, 0) for a in AXES)
        return int(self.grid[idx])

    def groups(self, axis: str) -> list[list[int]]:
        """Every group of ``axis``, as rank lists in ascending order of the axis coordinate."""
        self._check_axis(axis)
        names: tuple[str, ...]
        if axis == Axis.DP_SP:
            c = self.config
            return self.grid.reshape(c.pp, c.zero_ranks, c.tp).movedim(1, -1).reshape(-1, c.zero_ranks).tolist()
        if axis in (Axis.EP, Axis.EDP):
            names, grid = (Axis.PP, Axis.EDP, Axis.EP, Axis.TP), self.expert_grid
        else:
            names = AXES if axis in AXES else self.fine_names
            grid = self.grid if axis in AXES else self.fine_grid
        dim = names.index(axis)
        return grid.movedim(dim, -1).reshape(-1, grid.shape[dim]).tolist()

    def group_of(self, rank: int, axis: str) -> list[int]:
        """The group of ``axis`` that contains ``rank``."""
        return next(g for g in self.groups(axis) if rank in g)

    def table(self) -> list[dict[str, int]]:
        """One row per rank with every coordinate: handy for printing or plotting."""
        return [{"rank": r, **self.all_coords(r)} for r in range(self.world_size)]

    def _check_axis(self, axis: str) -> None:
        if axis not in self.axes and axis != Axis.DP_SP:  # dp_sp: a flattened view, not an axis of its own
            raise ValueError(f"unknown axis {axis!r} for tp_mode={self.config.tp_mode!r}: "
                             f"this mesh has axes {', '.join(self.axes)}")

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside this mesh of {self.world_size} ranks (0..{self.world_size - 1})")

    def __repr__(self) -> str:
        return f"MeshLayout({self.config.describe()}, axes={self.axes})"


class ProcessMesh:
    """The real process groups of a config on the current torch.distributed world.

    Built on ``torch.distributed.device_mesh``: one DeviceMesh over
    ``(pp, dp, sp, tp)`` and, for the 2D/2.5D/3D modes, the tensor block
    unflattened into its sub-axes. Every rank builds the same mesh (it is a
    collective). Several meshes can live in one process.

    Inside a rank of ``ParallelConfig(dp=2, tp=2)``::

        mesh = ProcessMesh(cfg)
        mesh.rank("dp"), mesh.size("dp")   # rank 3 -> (1, 2)
        mesh.group("tp")                   # the ProcessGroup of ranks [2, 3]
        mesh.log                           # CommLog of collectives run through colab_kit.comm

    ``ProcessMesh.shared(cfg)`` is the mesh ``boost`` uses: one per config and world, reused
    by every engine of that config (building groups is a collective and each group holds
    connections, so a notebook that boosts in a loop must not make new ones each time).
    ``release()`` gives one engine's hold back; the last one destroys the groups.

    An engine dropped without ``close()`` gives its hold back at the next ``shared()`` (or
    ``ProcessMesh.prune()``), never from the garbage collector: when the collector runs
    differs from rank to rank, and a mesh destroyed on one rank while another still reuses it
    leaves the next collective waiting forever (the ranks would disagree on whether the next
    ``shared()`` builds groups, itself a collective). ``prune()`` runs a full collection first,
    at the same point of the program on every rank, so every rank sees the same engines gone.
    """

    # set in __init__; the meshes are None once release() destroyed the groups
    device_mesh: DeviceMesh | None
    tp_mesh: DeviceMesh | None
    ep_mesh: DeviceMesh | None
    users: int
    closed: bool
    _key: tuple | None
    _holders: list

    _shared: dict = {}
    abort_flag: threading.Event | None = None
    """The job's hang flag: a ``threading.Event`` while a pipeline step runs (its executor sets and clears it),
    else None. Blocked waits in ``comm`` give up with ``comm.Aborted`` once it is set."""

    @classmethod
    def shared(cls, config: ParallelConfig, device_type: str | None = None) -> ProcessMesh:
        """The mesh of ``config`` on this world, built on first use and then reused; each call holds it once.

        >>> a = ProcessMesh.shared(cfg); b = ProcessMesh.shared(cfg)   # inside a rank  # doctest: +SKIP
        >>> a is b, a.users                                                             # doctest: +SKIP
        (True, 2)
        """
        if not dist.is_initialized():
            cls(config)  # raises the explanation
        cls.prune()
        world = dist.distributed_c10d._get_default_group()
        key = (config, device_type, id(world))
        mesh = cls._shared.get(key)
        if mesh is None or mesh.closed:
            mesh = cls._shared[key] = cls(config, device_type)
            mesh._key = key
        mesh.users += 1
        return mesh

    def hold(self) -> bool:
        """Take one more hold on this mesh, as ``shared()`` does, if it is a shared one (True); a mesh built
        directly (``ProcessMesh(cfg)``) is its builder's to release (False). ``boost(..., mesh=mesh)`` holds the
        mesh a cluster predefines, so that a new ``%colossal config`` (which gives the cluster's hold back)
        leaves the engines built on the old one working until they are closed."""
        if self._key is None or self.closed:
            return False
        self.users += 1
        return True

    def track(self, holder) -> None:
        """Note that ``holder`` (an engine) took one hold with ``shared()``: if it is dropped without
        giving it back, ``prune()`` does."""
        self._holders.append(weakref.ref(holder))

    def untrack(self, holder) -> None:
        self._holders = [w for w in self._holders if w() is not None and w() is not holder]

    @classmethod
    def prune(cls) -> int:
        """Give back the holds of engines dropped without ``close()`` (after a full garbage
        collection, so every rank that calls it at the same point agrees); meshes left with no
        hold are destroyed. Returns how many meshes were destroyed. ``shared()`` calls it.

        With no engine holding a shared mesh there is nothing to give back, and no collection is paid
        for (every rank sees the same table, so they still agree): a full one took about 0.25 s in a
        process with torch loaded, paid at every ``boost`` while an earlier engine was still open (7% of
        the CPU of tests/ranks went there). ``ck.launch``'s ranks and the notebook's engines freeze what
        they inherit from their fork server (``gc.freeze``), so a collection there scans only what the
        rank made since."""
        if not any(mesh._holders for mesh in cls._shared.values()):
            return 0
        gc.collect()
        destroyed = 0
        for mesh in list(cls._shared.values()):
            dead = [w for w in mesh._holders if w() is None]
            if not dead:
                continue
            mesh._holders = [w for w in mesh._holders if w() is not None]
            for _ in dead:
                mesh.release()
            destroyed += mesh.closed
        return destroyed

    def release(self) -> None:
        """Give back one hold from ``shared``; when none is left, destroy this mesh's process groups."""
        if self.closed:
            return
        self.users = max(0, self.users - 1)
        if self.users or self._key is None:
            return
        self.closed = True
        if self._shared.get(self._key) is self:
            del self._shared[self._key]
        groups = {id(g): g for g in self._all_groups()}
        for g in groups.values():
            if g is not dist.group.WORLD and g is not dist.distributed_c10d._get_default_group():
                try:
                    g.shutdown()  # closes the backend's connections; destroy alone leaves them open
                    dist.destroy_process_group(g)
                except (ValueError, RuntimeError):  # already gone (the world was torn down)
                    pass
        self._groups.clear()
        self.device_mesh = self.tp_mesh = self.ep_mesh = self.dp_sp_mesh = None  # connections close with the last ref

    def _all_groups(self) -> list:
        """Every process group this mesh built (its DeviceMesh dimensions, and the tensor sub-axes)."""
        out: list = list(getattr(self, "_extra_groups", []))
        for mesh in (self.device_mesh, self.tp_mesh, self.ep_mesh, self.dp_sp_mesh):
            if mesh is not None:
                out += [mesh.get_group(i) for i in range(mesh.ndim)]
        return out

    def __init__(self, config: ParallelConfig, device_type: str | None = None):
        from torch.distributed.device_mesh import init_device_mesh


        if not dist.is_initialized():
            raise RuntimeError("ProcessMesh needs torch.distributed to be initialised: run inside "
                               "ck.launch(fn, world_size) or a ck.Cluster, or call init_process_group")
        config.check_world_size(dist.get_world_size())
        self.config = config
        self.layout = MeshLayout(config)
        if device_type is None:  # NCCL's GPU; a rules group's own device (cuda: ranks sharing a GPU, comm.rules)
            device_type = "cuda" if dist.get_backend() == "nccl" else \
                getattr(dist.distributed_c10d._get_default_group(), "device_type", "cpu")
        self.device_type = device_type
        self.device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" \
            else torch.device("cpu")
        self.global_rank = dist.get_rank()
        self.device_mesh = init_device_mesh(device_type, tuple(config.shape.values()), mesh_dim_names=_names(*AXES))
        self.tp_mesh = self.ep_mesh = self.dp_sp_mesh = None
        self._extra_groups: list = []  # groups a mesh made on the way (the flattened dp x sp)
        if self.layout.sub:
            self.tp_mesh = self._tensor_sub_mesh(device_type)
        if config.dp > 1 and config.sp > 1:  # made with the rest (a collective), used by data parallelism and ZeRO
            self.dp_sp_mesh = self._flat_dp_sp(device_type)
        if self.layout.ep > 1:
            self.ep_mesh = self._expert_mesh(device_type)
        self.log = CommLog()
        QUEUED_COMPLETES[0] = dist.get_backend() == "nccl"  # finish() then reads completion from is_completed()
        self.users, self.closed, self._key = 0, False, None
        self._holders = []  # weak references to the engines holding this mesh (``track``)
        # looked up on every collective: computed once (slicing a DeviceMesh costs ~1 ms)
        self._coords = self.layout.all_coords(self.global_rank)
        self._dp_sp = self.layout.dp_sp(self._coords)  # rank(Axis.DP_SP)
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._ranks: dict[str, list[int]] = {}

    def _tensor_sub_mesh(self, device_type: str):
        """The tp block unflattened into its sub-axes (a DeviceMesh over pp, dp, sp, *sub)."""
        sub = self.layout.sub
        assert self.device_mesh is not None  # called from __init__, after it is built
        try:  # no new process groups for pp/dp/sp; private in torch 2.13, hence the fallback
            return self.device_mesh[Axis.TP]._unflatten(0, tuple(sub.values()), _names(*sub))
        except AttributeError:
            from torch.distributed.device_mesh import init_device_mesh
            shape = tuple(self.config.shape[a] for a in (Axis.PP, Axis.DP, Axis.SP)) + tuple(sub.values())
            return init_device_mesh(device_type, shape, mesh_dim_names=_names(Axis.PP, Axis.DP, Axis.SP, *sub))

    def _flat_dp_sp(self, device_type: str):
        """The dp x sp block flattened into ``dp_sp`` (a DeviceMesh with that dimension)."""
        assert self.device_mesh is not None
        try:  # private in torch 2.13, hence the fallback (which makes pp and tp groups again)
            folded = self.device_mesh[Axis.DP, Axis.SP]._flatten(str(Axis.DP_SP))
            self._extra_groups.append(folded.get_group())
            return folded
        except AttributeError:
            from torch.distributed.device_mesh import init_device_mesh
            shape = (self.config.pp, self.config.zero_ranks, self.config.tp)
            return init_device_mesh(device_type, shape, mesh_dim_names=_names(Axis.PP, Axis.DP_SP, Axis.TP))

    def _expert_mesh(self, device_type: str):
        """The dp x sp block folded into ``(edp, ep)`` (a DeviceMesh over those two axes)."""
        assert self.device_mesh is not None
        fold = (self.layout.size(Axis.EDP), self.layout.size(Axis.EP))
        try:  # private in torch 2.13, hence the fallback (which makes pp and tp groups again)
            folded = self.dp_sp_mesh if self.dp_sp_mesh is not None and self.dp_sp_mesh.ndim == 1 else \
                self.device_mesh[Axis.DP, Axis.SP]._flatten(str(Axis.DP_SP))
            if folded is not self.dp_sp_mesh:
                self._extra_groups.append(folded.get_group())
            return folded._unflatten(0, fold, _names(Axis.EDP, Axis.EP))
        except AttributeError:
            from torch.distributed.device_mesh import init_device_mesh
            shape = (self.config.pp, *fold, self.config.tp)
            return init_device_mesh(device_type, shape, mesh_dim_names=_names(Axis.PP, Axis.EDP, Axis.EP, Axis.TP))

    def _mesh_for(self, axis: str):
        self.layout._check_axis(axis)
        if axis == Axis.DP_SP:  # dp's or sp's own groups where the other is 1
            if self.dp_sp_mesh is None:
                assert self.device_mesh is not None, "a released mesh has no groups"
                return self.device_mesh[Axis.SP if self.config.dp == 1 else Axis.DP]
            return self.dp_sp_mesh if self.dp_sp_mesh.ndim == 1 else self.dp_sp_mesh[axis]
        mesh = self.device_mesh if axis in AXES else self.ep_mesh if axis in (Axis.EP, Axis.EDP) else self.tp_mesh
        assert mesh is not None, "a released mesh has no groups"  # group() refuses a closed mesh first
        return mesh[axis]

    def group(self, axis: str) -> dist.ProcessGroup:
        """The ProcessGroup of ``axis`` that contains this rank."""
        if axis not in self._groups:
            if self.closed:
                raise RuntimeError(f"this mesh ({self.config.describe()}) was released with the last engine that "
                                   "used it (engine.close()), or by whoever built it: boost again, or use "
                                   "ProcessMesh.shared(config)")
            self._groups[axis] = self._mesh_for(axis).get_group()
        return self._groups[axis]

    def rank(self, axis: str) -> int:
        """This rank's coordinate on ``axis`` (its rank inside the group)."""
        if axis not in self._coords:
            self.layout._check_axis(axis)
            if axis == Axis.DP_SP:
                return self._dp_sp
        return self._coords[axis]

    def size(self, axis: str) -> int:
        return self.layout.size(axis)

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group on ``axis``."""
        if axis not in self._ranks:
            self._ranks[axis] = self.layout.group_of(self.global_rank, axis)
        return list(self._ranks[axis])

    def coords(self) -> dict[str, int]:
        return dict(self._coords)

    def __repr__(self) -> str:
        return f"ProcessMesh(rank {self.global_rank}: {self.coords()}, {self.config.describe()})"
