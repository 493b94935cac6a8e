"""The typed remote interfaces (asyncrl/interfaces.py): every implementation has every verb with the
interface's parameters, verbs are named by reference only, and the Serve deployment's control
surface is derived from the interface."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from asyncrl.interfaces import (
    ENGINE_BROADCAST_VERBS,
    ENGINE_CONTROL_VERBS,
    ROLE_VERBS,
    EngineAPI,
    LearnerRankAPI,
    RoleAPI,
    WorkerAPI,
    api_verbs,
    verb_name,
)

ROOT = Path(__file__).resolve().parents[2] / "asyncrl"


def _params(fn) -> list[tuple[str, object]]:
    """Parameter names and defaults, without `self`, nor the `_ray_trace_ctx` that `ray.remote(cls)`
    adds to a class's methods in place once an actor of it was started in this process."""
    sig = inspect.signature(inspect.unwrap(fn))
    return [(p.name, p.default) for p in sig.parameters.values() if p.name not in ("self", "_ray_trace_ctx")]


def _missing_or_different(api: type, impl: type, verbs: list[str]) -> dict[str, str]:
    bad = {}
    for name in verbs:
        ours = getattr(impl, name, None)
        if ours is None:
            bad[name] = "missing"
        elif _params(ours) != _params(getattr(api, name)):
            bad[name] = f"{_params(ours)} != {_params(getattr(api, name))}"
    return bad


def test_verb_name_takes_a_verb_by_reference_only():
    assert verb_name(EngineAPI, EngineAPI.pause) == "pause"
    with pytest.raises(TypeError, match="by reference"):
        verb_name(EngineAPI, "pause")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not a verb of EngineAPI"):
        verb_name(EngineAPI, RoleAPI.state)  # same name on another interface: still refused
    with pytest.raises(TypeError, match="may not be called here"):
        verb_name(EngineAPI, EngineAPI.generate, ENGINE_CONTROL_VERBS)
    with pytest.raises(TypeError, match="not a verb of EngineAPI"):
        verb_name(EngineAPI, lambda: None)


def test_the_engine_replica_implements_every_engine_verb():
    from asyncrl.generator.engine import EngineReplica

    assert _missing_or_different(EngineAPI, EngineReplica, api_verbs(EngineAPI)) == {}


def test_the_serve_deployment_forwards_every_control_verb_and_nothing_else_by_hand():
    from asyncrl.generator.deployment import GeneratorEngine

    cls = GeneratorEngine.func_or_class
    assert _missing_or_different(EngineAPI, cls, api_verbs(EngineAPI)) == {}
    # Written by hand: generation, Serve's health check, the constructor; every control verb is derived.
    written = {n for n, v in vars(cls).items() if inspect.isfunction(v) and not n.startswith("__")
               and inspect.unwrap(v).__qualname__.startswith("_GeneratorEngine.")}
    assert written == {"generate", "generate_stream", "check_health"}
    assert {v.__name__ for v in ENGINE_CONTROL_VERBS} | written == set(api_verbs(EngineAPI))


async def test_engine_control_refuses_a_verb_by_string_before_calling_anything():
    from asyncrl.generator.control import EngineControl

    class Handle:
        calls: list = []

        def broadcast(self, *args, **kwargs):
            self.calls.append(args)
            raise AssertionError("reached the replicas")

    control = EngineControl(Handle())
    with pytest.raises(TypeError, match="by reference"):
        await control.call("pause")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="may not be called here"):
        await control.call(EngineAPI.generate, None)
    assert Handle.calls == [] and EngineAPI.check_health in ENGINE_BROADCAST_VERBS


def test_the_worker_extension_implements_every_worker_verb():
    from asyncrl.generator.sglang_worker import SglangWorker
    from asyncrl.generator.worker_ext import WeightUpdateExtension

    assert _missing_or_different(WorkerAPI, WeightUpdateExtension, api_verbs(WorkerAPI)) == {}
    assert _missing_or_different(WorkerAPI, SglangWorker, api_verbs(WorkerAPI)) == {}  # (SGLang's replica: the same)


# The weight verbs of each interface: each answers one type (issue 64), never a dict read by which keys are present.
_WEIGHT_VERBS = {
    EngineAPI: ["load_bucket", "commit_update", "abort_update", "set_push_plan", "join_collective", "sync_from_source"],
    WorkerAPI: api_verbs(WorkerAPI),
    LearnerRankAPI: ["set_push_plan", "export_weights", "join_collective",
                     "take_host_copies"],
}


@pytest.mark.parametrize("api", list(_WEIGHT_VERBS), ids=lambda a: a.__name__)
def test_every_weight_verb_answers_one_declared_type(api):
    untyped = {}
    for name in _WEIGHT_VERBS[api]:
        answer = inspect.signature(getattr(api, name)).return_annotation
        if answer in (inspect.Signature.empty, "Any") or "dict[str, Any]" in str(answer):
            untyped[name] = answer
    assert untyped == {}


def test_the_learner_rank_and_roles_implement_their_verbs():
    from asyncrl.learner.rank import LearnerRank
    from asyncrl.learner.roles import ROLE_CLASSES

    assert _missing_or_different(LearnerRankAPI, LearnerRank, api_verbs(LearnerRankAPI)) == {}
    assert {v.__name__ for v in ROLE_VERBS} == set(api_verbs(RoleAPI))
    implemented: set[str] = set()
    for cls in ROLE_CLASSES.values():
        mine = [n for n in api_verbs(RoleAPI) if hasattr(cls, n)]
        implemented |= set(mine)
        assert {n: p for n, p in ((n, _params(getattr(cls, n))) for n in mine)
                if [x for x, _ in p] != [x for x, _ in _params(getattr(RoleAPI, n))]} == {}, cls
    assert implemented == set(api_verbs(RoleAPI))  # every verb has a role that runs it


# Methods that reach another process (a Ray or Serve handle, vLLM's collective_rpc, the fan-outs
# and dispatchers built on them): none may be handed a verb as a string literal.
_REMOTE_CALLERS = {"call", "_call", "_rpc", "rpc", "collective_rpc", "broadcast", "_broadcast", "_all", "_compute",
                   "_per_token", "_engines", "_each"}


def _string_named_calls() -> list[str]:
    found = []
    for path in sorted([*ROOT.rglob("*.py"), *(ROOT.parent / "benchmarks").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            first = node.args[0] if node.args else None
            literal = isinstance(first, ast.Constant) and isinstance(first.value, str)
            if name in _REMOTE_CALLERS and literal and not (name == "broadcast" and path.name == "collective.py"):
                found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {name}({first.value!r})")
            # getattr(handle, "verb").remote(...)
            if (isinstance(func, ast.Attribute) and func.attr == "remote" and isinstance(func.value, ast.Call)
                    and isinstance(func.value.func, ast.Name) and func.value.func.id == "getattr"
                    and isinstance(func.value.args[1], ast.Constant)):
                found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} getattr(..., {func.value.args[1].value!r}).remote")
    return found


def test_no_remote_call_is_named_by_a_string():
    assert _string_named_calls() == []


def test_a_refusal_is_a_type_that_survives_the_boundaries():
    """An engine's refusal (nothing applied) reaches the publisher as `Refusal`, not as message text:
    through pickling (Ray and Serve), the deployment's tag, the fan-out's error and a cause chain."""
    import pickle

    from asyncrl.generator.control import ReplicaControlError
    from asyncrl.generator.deployment import ReplicaCallError
    from asyncrl.generator.engine_update import FingerprintMismatch, PlanMissing
    from asyncrl.generator.replica_types import WeightUpdateError
    from asyncrl.types import Refusal, refusal_of

    def is_verify_failure(exc: BaseException) -> bool:  # what the publisher asks of a failed commit: nothing applied
        return refusal_of(exc) is Refusal.VERIFY_FAILED

    err = pickle.loads(pickle.dumps(WeightUpdateError("replica r: rejected", Refusal.VERIFY_FAILED)))
    assert err.refusal is Refusal.VERIFY_FAILED and str(err) == "replica r: rejected"
    tagged = pickle.loads(pickle.dumps(ReplicaCallError("r", "commit_update", "boom", refusal_of(err))))
    assert tagged.refusal is Refusal.VERIFY_FAILED and tagged.replica_id == "r"
    assert refusal_of(PlanMissing("plan p")) is Refusal.PLAN_MISSING
    assert refusal_of(FingerprintMismatch("x")) is Refusal.VERIFY_FAILED
    try:  # a cause chain, as Ray's RayTaskError(cause) or `raise ... from` build it
        try:
            raise PlanMissing("plan p")
        except PlanMissing as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert refusal_of(outer) is Refusal.PLAN_MISSING
    # The first typed error decides: an apply that failed (refusal None) is not a refusal, even if
    # it was raised while handling one.
    try:
        try:
            raise FingerprintMismatch("x")
        except FingerprintMismatch:
            raise WeightUpdateError("replica r: commit failed while applying")
    except WeightUpdateError as applied:
        assert refusal_of(applied) is None and not is_verify_failure(applied)
    # The text alone no longer counts: a message that says it is not a refusal.
    assert not is_verify_failure(RuntimeError("fingerprint mismatch for version 3"))
    assert is_verify_failure(err)
    # A fan-out's error has one refusal only when every failed replica gave the same one.
    both = ReplicaControlError("commit_update", {"a": "x", "b": "y"}, {}, {"a": Refusal.VERIFY_FAILED, "b": Refusal.VERIFY_FAILED})
    mixed = ReplicaControlError("commit_update", {"a": "x", "b": "y"}, {}, {"a": Refusal.VERIFY_FAILED})
    assert both.refusal is Refusal.VERIFY_FAILED and is_verify_failure(both)
    assert mixed.refusal is None and not is_verify_failure(mixed)


def test_a_failure_while_applying_and_a_partial_fan_out_survive_the_boundaries():
    """A load that commits (one-call ipc push) may fail before anything was applied or while
    applying; and a fan-out may fail on one replica after another committed. The publisher tells
    them apart (to restore and resume only where weights may have changed) from typed fields that
    survive pickling, the deployment's tag and the fan-out's error, never from the message."""
    import pickle

    from asyncrl.generator.control import ReplicaControlError
    from asyncrl.generator.deployment import ReplicaCallError
    from asyncrl.generator.replica_types import WeightUpdateError
    from asyncrl.types import Refusal
    from asyncrl.types import failed_applying as is_apply_failure

    applying = pickle.loads(pickle.dumps(WeightUpdateError("replica r: failed while applying", applying=True)))
    refused = pickle.loads(pickle.dumps(WeightUpdateError("replica r: rejected", Refusal.VERIFY_FAILED)))
    assert is_apply_failure(applying) and not is_apply_failure(refused)
    assert not is_apply_failure(RuntimeError("failed while applying"))  # the text alone does not count
    tagged = pickle.loads(pickle.dumps(ReplicaCallError("r", "load_bucket", "boom", None, True)))
    assert tagged.applying and is_apply_failure(tagged)
    try:  # as Ray delivers it: the tagged error as the cause of another
        raise RuntimeError("remote") from tagged
    except RuntimeError as outer:
        assert is_apply_failure(outer)
    fan_out = ReplicaControlError("load_bucket", {"b": "staging failed"}, {"a": {"replica_id": "a", "version": 4}}, {}, {"b"})
    assert fan_out.applying and is_apply_failure(fan_out)
    clean = ReplicaControlError("load_bucket", {"b": "staging failed"}, {}, {})
    assert not clean.applying and not is_apply_failure(clean)
