"""The push channel (asyncrl/weightsync/push_channel.py) and its use by the service's replica client:
a call runs on the replica's loop and its result or exception comes back; a wrong token, an unserved
verb or a lost connection fail at once; the training loop's loads go over the channels only while the
replicas with one are exactly the groups' members, and fail as a Serve broadcast would."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from asyncrl.generator.replica_types import WeightUpdateError
from asyncrl.types import ChannelAddress, Endpoint, Refusal, ReplicaControlError
from asyncrl.weightsync.collective import CollectiveReceive
from asyncrl.weightsync.push_channel import ChannelClient, ChannelClosed, ChannelServer, _frame
from asyncrl.weightsync.replicas import DeploymentReplicas


class Replica:
    """Stands in for an engine replica's `load_bucket` (its loop is the test's)."""

    def __init__(self, rid: str, refuse: Refusal | None = None, applying: bool = False) -> None:
        self.rid, self.refuse, self.applying = rid, refuse, applying
        self.calls: list = []
        self.release = asyncio.Event()
        self.release.set()

    async def load_bucket(self, payload, version):
        self.calls.append((payload, version))
        await self.release.wait()
        if self.refuse is not None or self.applying:
            raise WeightUpdateError(f"replica {self.rid}: no", self.refuse, applying=self.applying)
        return {"replica_id": self.rid, "version": version}

    async def secret(self):
        return "must not be served"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_a_call_runs_on_the_replica_and_its_result_or_exception_comes_back():
    async def scenario():
        slow, fast = Replica("slow"), Replica("fast")
        slow.release.clear()
        servers = [ChannelServer(slow, ["load_bucket"]), ChannelServer(fast, ["load_bucket"])]
        a, b = [await ChannelClient.connect(await s.address("127.0.0.1")) for s in servers]
        pending = asyncio.ensure_future(a.call("load_bucket", "p", 3))
        second = asyncio.ensure_future(a.call("load_bucket", "q", 4))  # two in flight on one connection
        assert await b.call("load_bucket", "r", 5) == {"replica_id": "fast", "version": 5}
        slow.release.set()
        assert await pending == {"replica_id": "slow", "version": 3}
        assert await second == {"replica_id": "slow", "version": 4}
        assert slow.calls == [("p", 3), ("q", 4)]
        refusing = Replica("x", Refusal.PLAN_MISSING)
        c = await ChannelClient.connect(await ChannelServer(refusing, ["load_bucket"]).address("127.0.0.1"))
        with pytest.raises(WeightUpdateError) as err:
            await c.call("load_bucket", "p", 1)
        assert err.value.refusal is Refusal.PLAN_MISSING  # typed, as across Ray
        with pytest.raises(ValueError, match="not served here"):
            await a.call("secret")
        assert not a.closed  # a refused verb leaves the connection usable
        for client in (a, b, c):
            client.close()
        for s in servers:
            s.close()

    run(scenario())


def test_a_wrong_token_or_a_lost_connection_fails_every_call_at_once():
    async def scenario():
        replica = Replica("r")
        server = ChannelServer(replica, ["load_bucket"])
        address = await server.address("127.0.0.1")
        stranger = await ChannelClient.connect(msgspec.structs.replace(address, token="0" * 32))
        with pytest.raises(ChannelClosed):
            await stranger.call("load_bucket", "p", 1)
        assert replica.calls == []  # nothing read past the wrong token
        reader, writer = await asyncio.open_connection(address.host, address.port)
        writer.write(_frame(address.token.encode()) + _frame(b"not a pickle"))
        assert await reader.read() == b""  # a malformed call ends that connection, not the server
        assert await (await ChannelClient.connect(address)).call("load_bucket", "p", 0) == {"replica_id": "r", "version": 0}
        replica.calls.clear()
        client = await ChannelClient.connect(address)
        replica.release.clear()
        waiting = asyncio.ensure_future(client.call("load_bucket", "p", 2))
        await asyncio.sleep(0.1)
        server.close()  # the replica goes away mid-call
        with pytest.raises(ChannelClosed):
            await waiting
        assert client.closed
        with pytest.raises(ChannelClosed):
            await client.call("load_bucket", "p", 3)
        replica.release.set()

    run(scenario())


async def _answer(server: ChannelServer) -> ChannelAddress:
    """The replica's `push_channel` answer for its server."""
    return ChannelAddress(replica_id="r", endpoint=await server.address("127.0.0.1"))


class Control:
    """The generator's EngineControl: answers `push_channel` with each replica's address and records
    what goes through Serve."""

    def __init__(self, replicas: dict[str, Replica]) -> None:
        self.servers = {rid: ChannelServer(r, ["load_bucket"]) for rid, r in replicas.items()}
        self.replicas = replicas
        self.calls: list[str] = []

    async def call(self, verb, *args, timeout_s=None):
        self.calls.append(verb.__name__)
        if verb.__name__ == "push_channel":
            return {rid: ChannelAddress(replica_id=rid, endpoint=await s.address("127.0.0.1")) for rid, s in self.servers.items()}
        outcomes = await asyncio.gather(*(getattr(r, verb.__name__)(*args) for r in self.replicas.values()),
                                        return_exceptions=True)
        failures = {rid: str(o) for rid, o in zip(self.replicas, outcomes) if isinstance(o, BaseException)}
        results = {rid: o for rid, o in zip(self.replicas, outcomes) if not isinstance(o, BaseException)}
        if failures:
            raise ReplicaControlError(verb.__name__, failures, results)
        return results


def test_the_loops_loads_go_over_the_channels_while_they_reach_exactly_the_groups_members():
    async def scenario():
        replicas = {"a": Replica("a"), "b": Replica("b", applying=True)}
        control = Control(replicas)
        members = {"a": 1, "b": 1}
        client = DeploymentReplicas(control, 30.0)
        client.channel_members = lambda: members
        payload = CollectiveReceive(("g",), 7, commit=True, stream=True)
        with pytest.raises(ReplicaControlError):  # no channels yet: through Serve
            await client.load_bucket(payload, 7)
        assert control.calls == ["load_bucket"] and not client.last_load_channel
        await client.open_channels(list(members))
        assert set(client.channels) == {"a", "b"}
        with pytest.raises(ReplicaControlError) as err:  # b fails while applying: reported as Serve reports it
            await client.load_bucket(payload, 7)
        assert client.last_load_channel and control.calls == ["load_bucket", "push_channel"]
        assert err.value.results == {"a": {"replica_id": "a", "version": 7}} and err.value.failed_applying == {"b"}
        replicas["b"].applying = False
        assert await client.load_bucket(payload, 8) == {"a": {"replica_id": "a", "version": 8},
                                                          "b": {"replica_id": "b", "version": 8}}
        assert client.last_results == {"a": {"replica_id": "a", "version": 8}, "b": {"replica_id": "b", "version": 8}}
        assert control.calls == ["load_bucket", "push_channel"]  # nothing more through Serve
        assert await client.load_bucket("not a collective payload", 9) and control.calls[-1] == "load_bucket"
        members["c"] = 1  # the groups were formed again with a new replica: through Serve, channels dropped
        await client.load_bucket(payload, 10)
        assert not client.last_load_channel and client.channels == {} and control.calls[-1] == "load_bucket"
        del members["c"]
        await client.open_channels(list(members))
        control.servers["b"].close()  # a replica died: its load fails at once, and the channels are dropped
        with pytest.raises(ReplicaControlError, match="ChannelClosed"):
            await client.load_bucket(payload, 11)
        assert client.channels == {}
        await client.open_channels(["a"])  # the running replicas are not the groups' members: none opened
        assert client.channels == {}

    run(scenario())


def test_the_publisher_opens_channels_after_a_push_and_tries_failed_ones_again_later():
    from types import SimpleNamespace

    from asyncrl.config import WeightsyncConfig
    from asyncrl.weightsync.service import CHANNEL_RETRY_PUSHES, WeightPublisher

    class Replicas:
        def __init__(self, answers):
            self.answers, self.asked, self.channels = list(answers), [], {}

        async def open_channels(self, members):
            self.asked.append(sorted(members))
            out = self.answers.pop(0)
            if isinstance(out, Exception):
                raise out
            self.channels = {m: object() for m in members} if out else {}
            return out

    def publisher(answers, on=True):
        wp = WeightPublisher.__new__(WeightPublisher)
        wp.cfg = WeightsyncConfig(push_channel=on)
        wp.link = SimpleNamespace(members={"a": 1, "b": 1})
        wp.replicas, wp._channels_failed = Replicas(answers), None
        return wp

    async def scenario():
        wp = publisher([False, True])  # b not running yet when asked: asked again after the next push
        await wp._refresh_channels(1)
        await wp._refresh_channels(2)
        await wp._refresh_channels(3)  # open for exactly the members: nothing to do
        assert wp.replicas.asked == [["a", "b"], ["a", "b"]]
        wp = publisher([None, RuntimeError("down"), True, True])  # a connection failed: not again for a while
        await wp._refresh_channels(1)
        await wp._refresh_channels(2)
        assert len(wp.replicas.asked) == 1
        await wp._refresh_channels(1 + CHANNEL_RETRY_PUSHES)  # tried again, and fails (raised): logged
        assert len(wp.replicas.asked) == 2 and wp.replicas.channels == {}
        wp.link.members = {"a": 1, "c": 1}  # other members: asked at once
        await wp._refresh_channels(22)
        assert wp.replicas.asked[-1] == ["a", "c"] and set(wp.replicas.channels) == {"a", "c"}
        off = publisher([True], on=False)
        await off._refresh_channels(1)
        assert off.replicas.asked == []  # weightsync.push_channel false: always through Serve

    run(scenario())


def test_a_thread_without_a_loop_calls_the_replica_once_and_gets_its_answer_or_its_error():
    """`BlockingChannel` and `call_once`: the blocking client a worker's receive thread reports the wire's end
    (posted, not waited for) and then its answer with, on one connection."""
    import threading

    from asyncrl.weightsync.push_channel import BlockingChannel, ChannelClosed, ChannelServer, call_once

    class Target:
        wired: list = []

        async def wire_end(self, call, rank):
            self.wired.append((call, rank))

        async def receive_done(self, call, rank, ok, answer):
            if not ok:
                raise ValueError(f"refused {call}")
            return {"call": call, "rank": rank, "answer": answer, "wired": list(self.wired)}

    async def main():
        server = ChannelServer(Target(), ["receive_done", "wire_end"])
        address = await server.address("127.0.0.1")
        out: dict = {}

        def worker():
            with BlockingChannel(address) as channel:  # posted calls run, their replies skipped by the next call's
                channel.post("wire_end", "c0", 1)
                channel.post("wire_end", "c0", 2)
                out["both"] = channel.call("receive_done", "c0", 1, True, "x")
            out["ok"] = call_once(address, "receive_done", "c1", 3, True, {"digests": {"a": b"\x01"}})
            try:
                call_once(address, "receive_done", "c2", 0, False, "boom")
            except ValueError as err:
                out["err"] = str(err)
            try:
                call_once(msgspec.structs.replace(address, token="wrong"), "receive_done", "c3", 0, True, None, timeout_s=2)
            except ChannelClosed as err:  # the server closes a connection that does not present its token
                out["closed"] = str(err)

        thread = threading.Thread(target=worker)
        thread.start()
        while thread.is_alive():
            await asyncio.sleep(0.01)
        server.close()
        return out

    out = asyncio.run(main())
    assert out["both"] == {"call": "c0", "rank": 1, "answer": "x", "wired": [("c0", 1), ("c0", 2)]}
    assert out["ok"] == {"call": "c1", "rank": 3, "answer": {"digests": {"a": b"\x01"}}, "wired": [("c0", 1), ("c0", 2)]}
    assert out["err"] == "refused c2" and "closed" in out


def test_a_receive_apart_waits_for_every_worker_whenever_its_answer_comes_and_raises_a_failed_one():
    """ReplicaStaging's wait for workers that receive in threads of their own: answers may come before the start
    call returns (how many workers is known only then), they come back in rank order, a failed worker's text is
    raised (a gate that closed still reads as one), and a worker that never answers ends at the deadline."""
    from asyncrl.interfaces import WorkerAPI, verb_name
    from asyncrl.weightsync.collective import CollectiveReceive
    from asyncrl.weightsync.replica_side import ReplicaStaging

    async def main(answers, timeout_s=5.0, wired=None):
        staging: ReplicaStaging
        ends: list = []

        async def rpc(verb, *args, timeout=None):
            assert verb_name(WorkerAPI, verb) == "asyncrl_receive_start"
            call = args[-1]["call"]
            for rank in wired or ():  # the wire's end, reported before the start call returns
                staging.wire_end(call, rank)
                staging.wire_end(call, rank)  # (twice: once counts)
            for rank, ok, answer in answers:  # (one before the start call returns)
                staging.receive_done(call, rank, ok, answer)
                await asyncio.sleep(0)
            return [None, None]  # two workers started

        async def address():
            return ChannelAddress(replica_id="r", endpoint=Endpoint("h", 1, "t"))

        staging = ReplicaStaging(rpc, "r")
        staging.reply_address = address
        staging.version = 4
        if wired is not None:  # what the replica's pause at the wire's end takes: once, when every worker is there
            staging.on_wire_end = lambda: ends.append(len(ends))
        payload = CollectiveReceive(("g",), 4, timeout_s, apart=True)
        out = await staging._receive_apart(payload, 4, None)
        if wired is not None:
            assert ends == [0]
        return out

    assert asyncio.run(main([(1, True, "b"), (0, True, "a")])) == ["a", "b"]
    assert asyncio.run(main([(1, True, "b"), (0, True, "a")], wired=[])) == ["a", "b"]
    assert asyncio.run(main([(1, True, "b"), (0, True, "a")], wired=[0, 1])) == ["a", "b"]
    from asyncrl.weightsync.replica_side import _ApartCall

    async def partial():  # one worker of two at the wire's end: no pause yet; the second's answer completes it
        ends: list = []
        waiting = _ApartCall(asyncio.get_running_loop().create_future(), workers=2, on_wire_end=lambda: ends.append(1))
        waiting.wired.add(0)
        waiting.settle()
        first = list(ends)
        waiting.answers[1] = (True, "b")
        waiting.settle()
        waiting.settle()
        return first, ends, waiting.future.done()

    assert asyncio.run(partial()) == ([], [1], False)
    with pytest.raises(RuntimeError, match="a worker's receive failed: GateClosed: .*stopped at its gate"):
        asyncio.run(main([(0, True, "a"), (1, False, "GateClosed: group g: push x stopped at its gate")]))
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(main([(0, True, "a")], timeout_s=-29.9))  # (the wait is the receive's deadline + 30 s)


def test_a_workers_own_channel_serves_its_verbs_from_threads_and_refuses_the_rest():
    """`ThreadServer` (an engine worker's channel, served from threads): a call's result or exception comes back to
    an async `ChannelClient`; an unserved verb is refused by name; a connection without the token is closed
    unread; after `close` a new connection is refused."""
    from asyncrl.weightsync.push_channel import ThreadServer

    class Worker:
        def __init__(self):
            self.started: list = []

        def asyncrl_receive_start(self, version, reply):
            if version < 0:
                raise ValueError("a receive apart from the engine is still running on this worker")
            self.started.append((version, reply))

        def asyncrl_apply(self, version):
            raise AssertionError("must not be served")

    async def main():
        worker = Worker()
        server = ThreadServer(worker, ["asyncrl_receive_start"], "127.0.0.1")
        client = await ChannelClient.connect(server.address, "w0")
        out = {"first": await client.call("asyncrl_receive_start", 3, {"call": "c"})}
        with pytest.raises(ValueError, match="still running"):
            await client.call("asyncrl_receive_start", -1, {})
        with pytest.raises(ValueError, match="'asyncrl_apply' is not served here"):
            await client.call("asyncrl_apply", 3)
        out["both"] = await asyncio.gather(*(client.call("asyncrl_receive_start", v, {}) for v in (4, 5)))
        wrong = await ChannelClient.connect(msgspec.structs.replace(server.address, token="nope"), "w0")
        with pytest.raises(ChannelClosed):
            await asyncio.wait_for(wrong.call("asyncrl_receive_start", 9, {}), 5)
        client.close()
        server.close()
        with pytest.raises(OSError):
            await asyncio.wait_for(asyncio.open_connection("127.0.0.1", server.address.port), 5)
        return out, worker.started

    out, started = run(main())
    assert out == {"first": None, "both": [None, None]}
    assert started == [(3, {"call": "c"}), (4, {}), (5, {})]  # 9 never ran: its connection had no token


def test_a_receive_apart_starts_over_the_workers_channels_and_reports_over_the_replicas():
    """`ReplicaStaging.direct_start`: the workers' channels are asked for once (through the engine), the receive
    starts over them, carrying the engine's pause lead, and each worker's answer comes back over the replica's
    own channel; a worker's channel that is gone fails that receive at once, and the next opens the channels again.
    Without `direct_start` the start goes through the engine, as before."""
    import threading

    from asyncrl.interfaces import WorkerAPI, verb_name
    from asyncrl.weightsync.push_channel import RECEIVE_DONE, ThreadServer, call_once
    from asyncrl.weightsync.replica_side import ReplicaStaging

    class Worker:
        def __init__(self, rank):
            self.rank, self.starts = rank, []

        def asyncrl_receive_start(self, version, group_ids, timeout_s, begin, with_sender, gate, reply):
            self.starts.append((version, reply["lead_s"]))
            address = msgspec.convert(reply["endpoint"], Endpoint)  # (as the worker does)
            threading.Thread(target=call_once, args=(address, RECEIVE_DONE, reply["call"], self.rank, True,
                                                     f"w{self.rank}")).start()

    async def main(direct):
        workers = [Worker(0), Worker(1)]
        servers = [ThreadServer(w, ["asyncrl_receive_start"], "127.0.0.1") for w in workers]
        engine_calls: list = []

        async def rpc(verb, *args, timeout=None):
            name = verb_name(WorkerAPI, verb)
            engine_calls.append(name)
            if name == "asyncrl_start_channel":
                assert args == ("127.0.0.1",)
                return [s.address for s in servers]
            assert name == "asyncrl_receive_start"
            return [w.asyncrl_receive_start(*args) for w in workers]

        staging = ReplicaStaging(rpc, "r")

        class ReplicaSide:  # (the replica's `receive_done`, engine_update.py)
            async def receive_done(self, *args):
                staging.receive_done(*args)

        replica = ChannelServer(ReplicaSide(), [RECEIVE_DONE])
        staging.reply_address = lambda: _answer(replica)
        staging.direct_start, staging.pause_lead_s, staging.version = direct, 0.004, 7
        payload = CollectiveReceive(("g",), 7, 10.0, apart=True)
        out = [await staging._receive_apart(payload, 7, None), await staging._receive_apart(payload, 7, None)]
        if direct:  # a worker's channel goes away: that receive fails, the next asks for the channels again
            servers[1].close()
            with pytest.raises(RuntimeError, match="r: a worker's channel failed starting a receive: ChannelClosed"):
                await staging._receive_apart(payload, 7, None)
            assert staging._worker_clients is None
            servers[1] = ThreadServer(workers[1], ["asyncrl_receive_start"], "127.0.0.1")
            out.append(await staging._receive_apart(payload, 7, None))
        staging.close_worker_channels()
        replica.close()
        for s in servers:
            s.close()
        return out, engine_calls, [w.starts for w in workers]

    out, calls, starts = run(main(True))
    assert out == [["w0", "w1"]] * 3
    assert calls == ["asyncrl_start_channel", "asyncrl_start_channel"]  # never the receive itself
    assert starts == [[(7, 0.004)] * 4, [(7, 0.004)] * 3]  # (worker 0 also took the receive that failed)
    out, calls, starts = run(main(False))
    assert out == [["w0", "w1"]] * 2 and calls == ["asyncrl_receive_start"] * 2


def test_the_wire_end_is_forecast_a_pause_ahead_of_the_last_bucket_and_reported_once():
    """`WireEndForecast`: with a lead, the wire's end is reported once the rest should land within it at the rate
    the buckets after the first landed at (never on the first bucket alone, never twice); without a lead, or
    without the group's table, only when the last bucket is in (`fire`); a table smaller than what landed (an
    earlier push's) is not trusted."""
    import time

    from asyncrl.generator.engine_update import PAUSE_LEAD_MAX_S, pause_lead
    from asyncrl.weightsync.worker_verbs import WireEndForecast

    class Table:
        nbytes = 10 * 100

    def landings(lead_s, table=Table(), gap_s=0.01, n=10):
        fired: list = []
        forecast = WireEndForecast(lambda: fired.append(k), lead_s)
        for k in range(n):
            forecast.landed(100, table)
            time.sleep(gap_s)
        k = "end"
        forecast.fire()
        forecast.fire()
        return fired

    assert landings(0.0) == ["end"]
    assert landings(0.5, table=None) == ["end"]
    early = landings(0.035)  # ~10 ms a bucket: fired when about 3 buckets are left, once
    assert len(early) == 1 and 5 <= early[0] <= 7, early
    assert landings(5.0) == [1]  # a lead longer than the wire: at the second bucket, never the first ...
    fired: list = []
    hinted = WireEndForecast(lambda: fired.append(1), 5.0, wire_rate=1e4)  # ... unless the last push's rate is known
    hinted.landed(100, Table())
    assert fired == [1] and hinted.rate() == 0.0
    time.sleep(0.01)
    hinted.landed(100, Table())  # a rate of its own from the second bucket on; reported once
    assert 0 < hinted.rate() <= 100 / 0.01 and fired == [1]
    small = type("T", (), {"nbytes": 250})()
    assert landings(5.0, table=small) == [1] and landings(0.001, table=small) == ["end"]
    assert pause_lead([]) == 0.0
    assert pause_lead([0.004, 0.010, 0.006]) == pytest.approx(0.009)
    assert pause_lead([2.0, 3.0]) == PAUSE_LEAD_MAX_S


def test_a_workers_runner_keeps_one_thread_for_its_jobs_and_never_queues_one_behind_a_stuck_job():
    """`_Runner` (a worker's receives apart, their report channels' openings): jobs handed over one after another
    run on the same kept thread, each job's result or exception on its future; a job handed over while one still
    runs (a connection still being tried) runs at once in a thread of its own."""
    import threading

    from asyncrl.weightsync.worker_verbs import _Runner

    runner = _Runner("asyncrl-test")
    first = runner.submit(lambda: threading.current_thread())
    kept = first.result(10)
    assert kept.daemon and kept.name == "asyncrl-test"
    assert runner.submit(lambda x: (threading.current_thread(), x + 1), 1).result(10) == (kept, 2)
    failed = runner.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failed.result(10)
    release = threading.Event()
    stuck = runner.submit(lambda: release.wait(10) and threading.current_thread())
    other = runner.submit(lambda: threading.current_thread())
    assert other.result(5) is not kept and not stuck.done()  # not behind the stuck one
    release.set()
    assert stuck.result(10) is kept and runner.submit(threading.current_thread).result(10) is kept


def test_workers_told_the_engine_paused_apply_themselves_and_a_receive_that_ends_untold_frees_them():
    """`ReplicaStaging.apply_paused_query`: a receive apart that commits asks the workers (over their channels) to
    apply once the engine paused, reading the query first; `engine_paused(True)` tells every worker once, and marks
    the receive as one that may have applied part (`told_apply`); a receive that ends before the word (cancelled
    here) tells them it is not coming (False), so that no worker waits for it to its deadline."""
    import threading

    from asyncrl.weightsync.push_channel import RECEIVE_DONE, ThreadServer, call_once
    from asyncrl.weightsync.replica_side import ReplicaStaging
    from asyncrl.weightsync.worker_verbs import PauseNotice

    class Worker:
        def __init__(self, rank):
            self.rank, self.heard, self.notice, self.threads = rank, [], None, []

        def asyncrl_receive_start(self, version, group_ids, timeout_s, begin, with_sender, gate, reply):
            assert reply["apply_paused"] and reply["query"] == "asyncrl_sampled_token_counts"
            self.notice, call = PauseNotice(), reply["call"]
            address = msgspec.convert(reply["endpoint"], Endpoint)  # (as the worker does)

            def run():
                told = self.notice.wait(10)
                self.heard.append(self.notice.ok if told else "deadline")
                call_once(address, RECEIVE_DONE, call, self.rank, True, {"digests": {}, "sender": {}, "applied": None})

            self.threads.append(threading.Thread(target=run))
            self.threads[-1].start()

        def asyncrl_engine_paused(self, call, ok):
            self.notice.set(ok)

    async def main():
        workers = [Worker(0), Worker(1)]
        servers = [ThreadServer(w, ["asyncrl_receive_start", "asyncrl_engine_paused"], "127.0.0.1") for w in workers]

        async def rpc(verb, *args, timeout=None):
            return [s.address for s in servers]  # (asyncrl_start_channel: nothing else goes through the engine)

        staging = ReplicaStaging(rpc, "r")

        class ReplicaSide:
            async def receive_done(self, *args):
                staging.receive_done(*args)

        replica = ChannelServer(ReplicaSide(), [RECEIVE_DONE])
        staging.reply_address = lambda: _answer(replica)
        staging.direct_start, staging.version = True, 3
        staging.apply_paused_query = "asyncrl_sampled_token_counts"
        payload = CollectiveReceive(("g",), 3, 10.0, apart=True, commit=True)
        receiving = asyncio.ensure_future(staging._receive_apart(payload, 3, None))
        while not all(w.notice for w in workers):
            await asyncio.sleep(0.01)
        staging.engine_paused(True)
        staging.engine_paused(True)  # (once)
        answers = await receiving
        told = staging.told_apply
        receiving = asyncio.ensure_future(staging._receive_apart(payload, 3, None))
        while not all(w.notice and not w.notice.is_set() for w in workers):
            await asyncio.sleep(0.01)
        receiving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await receiving
        while not all(len(w.heard) == 2 for w in workers):
            await asyncio.sleep(0.01)
        while any(t.is_alive() for w in workers for t in w.threads):  # (their reports reach the replica first)
            await asyncio.sleep(0.01)
        staging.close_worker_channels()
        replica.close()
        for s in servers:
            s.close()
        return answers, told, [w.heard for w in workers]

    answers, told, heard = run(main())
    assert len(answers) == 2 and told is True
    assert heard == [[True, False], [True, False]]
