"""The database's claim against its reference model (domain/scheduling/claim_model.py), on
SQLite and PostgreSQL: generated orgs, weights, credit, lanes, chunks, deadlines, urgency,
priorities, pauses and backoffs go into the real store; each claim the store makes must take
the chunks and lines the model takes from the same state, and leave every lane at the virtual
time the model says, and every lane counts exactly its running batches' ready chunks; each
batch that starts must level its lane as the model says."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter, defaultdict

from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import bindparam, text

from backfill.adapters.db.store import SqlStore
from backfill.domain.catalog import Billing
from backfill.domain.chunks import Chunker
from backfill.domain.lifecycle import BatchStatus, ItemState
from backfill.domain.lines import LineRef
from backfill.domain.records import BatchRecord, Org
from backfill.domain.scheduling.claim_model import (
    ChunkState,
    ChunkView,
    LaneView,
    claim,
    least_busy,
    level_on_reopen,
)
from backfill.domain.scheduling.planning import NOT_URGENT
from tests.contract.test_store import ADMIT_ALL, LEASE, NOW, file_record

# Each example works in models and orgs of its own, so one store serves them all.
_EXAMPLES = itertools.count()
_DEADLINE = int(NOW)
# Few distinct values, so that ties (the order's tie-breaks) come up often, and values at the
# bounds (a batch that expires at the claim's time, a backoff that ends then).
_EXPIRES = [_DEADLINE, _DEADLINE + 100, _DEADLINE + 100, _DEADLINE + 200]
_URGENT_BY = [NOT_URGENT, NOT_URGENT, _DEADLINE + 150, _DEADLINE + 250]
_VTIMES = [0.0, 0.5, 1.0, 2.0, 3.25, 40.0]
_NOT_BEFORE = [None, NOW - 1, NOW, NOW + 5]
_PRIORITIES = [0, 0, 0, 5, -3]


@dataclasses.dataclass(frozen=True)
class BatchSpec:
    org: int
    model: int
    lines: int
    expires: int
    gpu_time: bool
    priority: int = 0


@dataclasses.dataclass(frozen=True)
class Scenario:
    chunk_lines: int
    weights: list[int]
    balances: list[int]
    batches: list[BatchSpec]
    first_opened: int
    last_opened: int
    pokes: list[tuple[int, float, int]]
    claims: list[tuple[int, int]]
    releases: list[tuple[int, float | None]]
    pauses: list[int] = dataclasses.field(default_factory=list)
    """Batches paused after the first claims (some validating still)."""
    resumes: list[int] = dataclasses.field(default_factory=list)
    """Batches resumed before the second claims."""
    reprioritised: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    """(batch, priority) changed before the second claims."""


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    # Often more lanes with work than a claim takes: which ones get the turn is then tested.
    orgs = draw(st.sampled_from([1, 3, 5, 6, 8, 9]))
    batch = st.builds(
        BatchSpec,
        org=st.integers(0, orgs - 1),
        model=st.sampled_from([0, 0, 1]),
        lines=st.integers(1, 20),
        expires=st.sampled_from(_EXPIRES),
        gpu_time=st.booleans(),
        priority=st.sampled_from(_PRIORITIES),
    )
    # Every org has a batch; some have more.
    first = [dataclasses.replace(draw(batch), org=org) for org in range(orgs)]
    batches = first + draw(st.lists(batch, max_size=6))
    # Batches start in two rounds; the rest stay validating (their chunks exist, unclaimable).
    first_opened = draw(st.integers(1, len(batches)))
    return Scenario(
        chunk_lines=draw(st.integers(2, 6)),
        weights=draw(st.lists(st.sampled_from([1, 1, 2, 3, 5]), min_size=orgs, max_size=orgs)),
        balances=draw(st.lists(st.sampled_from([0, 1, 1]), min_size=orgs, max_size=orgs)),
        batches=batches,
        first_opened=first_opened,
        last_opened=draw(st.integers(first_opened, len(batches))),
        pokes=draw(
            st.lists(
                st.tuples(
                    st.integers(0, 20), st.sampled_from(_VTIMES), st.sampled_from(_URGENT_BY)
                ),
                min_size=1,
                max_size=8,
            )
        ),
        # (the models the engine serves: the first, the second or both; lines it asks for)
        claims=draw(
            st.lists(st.tuples(st.integers(0, 2), st.integers(1, 30)), min_size=2, max_size=5)
        ),
        releases=draw(
            st.lists(st.tuples(st.integers(0, 1000), st.sampled_from(_NOT_BEFORE)), max_size=4)
        ),
        pauses=draw(st.lists(st.integers(0, len(batches) - 1), max_size=3)),
        resumes=draw(st.lists(st.integers(0, len(batches) - 1), max_size=2)),
        reprioritised=draw(
            st.lists(
                st.tuples(st.integers(0, len(batches) - 1), st.sampled_from(_PRIORITIES)),
                max_size=2,
            )
        ),
    )


class Harness:
    """One example's world in the store, and the model's view of it."""

    def __init__(self, store: SqlStore, scenario: Scenario) -> None:
        n = next(_EXAMPLES)
        self.store = store
        self.scenario = scenario
        self.models = [f"m{n:05d}-{j}" for j in range(2)]
        self.orgs = [
            Org(id=f"org_{n:05d}_{i}", name=f"o{n:05d}-{i}", created_at=_DEADLINE)
            for i in range(len(scenario.weights))
        ]
        # Later batches sort first: one not started yet ties ahead of its lane's started ones.
        self.batch_ids = [f"batch_{n:05d}_{99 - k:02d}" for k in range(len(scenario.batches))]
        self.leased: list[tuple[str, int]] = []

    async def create(self) -> None:
        """The orgs with their weights and credit, and every batch validating."""
        for org, weight, balance in zip(
            self.orgs, self.scenario.weights, self.scenario.balances, strict=True
        ):
            await self.store.create_org(org)
            await self.store.set_org_weight(org.id, weight)
            await self.execute("UPDATE orgs SET balance = :b WHERE id = :o", b=balance, o=org.id)
        for batch_id, spec in zip(self.batch_ids, self.scenario.batches, strict=True):
            await self.create_batch(batch_id, spec)

    async def create_batch(self, batch_id: str, spec: BatchSpec) -> None:
        org = self.orgs[spec.org]
        source = file_record(org)
        await self.store.create_file(source)
        batch = BatchRecord(
            id=batch_id,
            org_id=org.id,
            endpoint="/v1/chat/completions",
            model=self.models[spec.model],
            model_config_id="m-v1",
            input_file_id=source.id,
            completion_window="24h",
            status=BatchStatus.VALIDATING,
            created_at=_DEADLINE - 10,
            expires_at=spec.expires,
            total=spec.lines,
            billing=Billing.GPU_TIME if spec.gpu_time else Billing.CATALOG,
            priority=spec.priority,
        )
        await self.store.create_batch(batch, ADMIT_ALL)
        lines = [LineRef(i, i * 100, 100, f"req-{i}") for i in range(spec.lines)]
        chunker = Chunker(max_lines=self.scenario.chunk_lines)
        await self.store.add_items(batch_id, [*chunker.feed(lines), *chunker.close()])

    async def start(self, k: int) -> None:
        """Batch ``k`` starts: its lane must be levelled as the model says."""
        model = self.models[self.scenario.batches[k].model]
        org_id = self.orgs[self.scenario.batches[k].org].id
        before = {(lane.model, lane.org_id): lane for lane in await self.lanes()}
        own = before.get((model, org_id))
        expected = level_on_reopen(
            own.vtime if own else 0.0,
            own.ready if own else 0,
            least_busy(list(before.values()), model),
        )
        moved = await self.store.transition(
            self.batch_ids[k], [BatchStatus.VALIDATING], BatchStatus.IN_PROGRESS, _DEADLINE
        )
        assert moved
        after = {(lane.model, lane.org_id): lane.vtime for lane in await self.lanes()}
        expected_vtimes = {key: lane.vtime for key, lane in before.items()}
        expected_vtimes[(model, org_id)] = expected
        assert after == expected_vtimes

    async def poke(self) -> None:
        """Lanes moved to generated virtual times and urgency (as history and plans do)."""
        lanes = sorted((lane.model, lane.org_id) for lane in await self.lanes())
        for which, vtime, urgent_by in self.scenario.pokes:
            model, org_id = lanes[which % len(lanes)]
            await self.execute(
                "UPDATE lanes SET vtime = :v, urgent_by = :u WHERE model = :m AND org_id = :o",
                v=vtime,
                u=urgent_by,
                m=model,
                o=org_id,
            )

    async def claims(self, token: str) -> None:
        """Each claim the store makes is the model's, from the same state."""
        for which, limit in self.scenario.claims:
            models = self.models if which == 2 else [self.models[which]]
            lanes = await self.lanes()
            balances = {org.id: b for org, b in zip(self.orgs, self.scenario.balances, strict=True)}
            model = claim(lanes, balances, models, limit, NOW)
            got = await self.store.claim(models, limit, token, NOW + LEASE, NOW)
            picks = {(c.batch.id, c.chunk): tuple(i.idx for i in c.items) for c in got}
            assert picks == {(p.batch_id, p.chunk): p.lines for p in model.picks}
            per_org = Counter({c.batch.org_id: len(c.items) for c in got})
            assert per_org == Counter({p.org_id: len(p.lines) for p in model.picks})
            vtimes = {(lane.model, lane.org_id): lane.vtime for lane in await self.lanes()}
            assert vtimes == model.vtimes
            self.leased += [(c.batch.id, i.idx) for c in got for i in c.items]

    async def controls(self) -> None:
        """Some batches paused, some resumed, some given another priority (the store's
        controls; a batch that cannot be controlled any more is left as it is)."""
        for k in self.scenario.pauses:
            await self.store.pause(self.batch_ids[k], _DEADLINE)
        await self.check_ready()
        for k, priority in self.scenario.reprioritised:
            await self.store.set_priority(self.batch_ids[k], priority)
        for k in self.scenario.resumes:
            await self.store.resume(self.batch_ids[k])
        await self.check_ready()

    async def check_ready(self) -> None:
        """Every lane counts exactly its running batches' ready chunks."""
        lanes = await self.lanes()
        for lane in lanes:
            counted = sum(1 for c in lane.chunks if c.state == ChunkState.READY and c.running)
            assert lane.ready == counted, (lane.model, lane.org_id)

    async def release(self, token: str) -> None:
        """Some claimed lines go back to the queue, some with a backoff not yet over."""
        for which, not_before in self.scenario.releases:
            if self.leased:
                batch_id, idx = self.leased.pop(which % len(self.leased))
                await self.store.release(batch_id, idx, token, not_before)

    async def lanes(self) -> list[LaneView]:
        """The model's view of this example's lanes, read from the store's tables."""
        async with self.store.engine.connect() as conn:
            lanes = (
                await conn.execute(
                    text(
                        "SELECT l.model, l.org_id, l.vtime, l.ready, l.metered, l.urgent_by,"
                        " o.weight FROM lanes l JOIN orgs o ON o.id = l.org_id"
                        " WHERE l.model IN :models"
                    ).bindparams(bindparam("models", expanding=True)),
                    {"models": self.models},
                )
            ).all()
            chunks = (
                await conn.execute(
                    text(
                        "SELECT c.batch_id, c.chunk, c.end_idx, c.model, c.org_id, c.expires_at,"
                        " c.state, c.not_before, c.rank, b.status FROM chunks c"
                        " JOIN batches b ON b.id = c.batch_id WHERE c.model IN :models"
                    ).bindparams(bindparam("models", expanding=True)),
                    {"models": self.models},
                )
            ).all()
            queued = (
                await conn.execute(
                    text(
                        "SELECT batch_id, chunk, idx, lease_until FROM items"
                        " WHERE batch_id IN :batches AND state = :queued"
                    ).bindparams(bindparam("batches", expanding=True)),
                    {"batches": self.batch_ids, "queued": ItemState.QUEUED},
                )
            ).all()
        lines: defaultdict[tuple[str, int], dict[int, float | None]] = defaultdict(dict)
        for row in queued:
            lines[(row.batch_id, row.chunk)][row.idx] = row.lease_until
        of_lane: defaultdict[tuple[str, str], list[ChunkView]] = defaultdict(list)
        for row in chunks:
            of_lane[(row.model, row.org_id)].append(
                ChunkView(
                    batch_id=row.batch_id,
                    chunk=row.chunk,
                    end_idx=row.end_idx,
                    expires_at=row.expires_at,
                    queued=lines[(row.batch_id, row.chunk)],
                    state=ChunkState(row.state),
                    not_before=row.not_before,
                    running=row.status == BatchStatus.IN_PROGRESS,
                    rank=row.rank,
                )
            )
        return [
            LaneView(
                model=row.model,
                org_id=row.org_id,
                weight=row.weight,
                vtime=row.vtime,
                ready=row.ready,
                metered=bool(row.metered),
                urgent_by=row.urgent_by,
                chunks=tuple(of_lane[(row.model, row.org_id)]),
            )
            for row in lanes
        ]

    async def execute(self, sql: str, **params: object) -> None:
        async with self.store.engine.begin() as conn:
            await conn.execute(text(sql), params)


async def play(store: SqlStore, scenario: Scenario) -> None:
    world = Harness(store, scenario)
    await world.create()
    for k in range(scenario.first_opened):
        await world.start(k)
    await world.poke()
    await world.claims("t1")
    await world.controls()
    await world.release("t1")
    await world.check_ready()
    for k in range(scenario.first_opened, scenario.last_opened):
        await world.start(k)
    await world.check_ready()
    await world.poke()
    await world.claims("t2")


# More level lanes than a claim takes: the tie-breaks of the turn decide which.
LEVEL_LANES = Scenario(
    chunk_lines=4,
    weights=[1] * 6,
    balances=[1] * 6,
    batches=[BatchSpec(org, 0, 10, _DEADLINE + 100, False) for org in range(6)],
    first_opened=6,
    last_opened=6,
    pokes=[(0, 0.0, NOT_URGENT)],
    claims=[(0, 30), (2, 30)],
    releases=[],
)


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    # No shrinking: every example costs dozens of transactions, and shrinking one ran past the
    # test's timeout. The failing example is reported as generated (derandomized: it recurs).
    phases=[Phase.explicit, Phase.generate],
    # One store for every example: each works in models and orgs of its own.
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(scenario=scenarios())
@example(scenario=LEVEL_LANES)
async def test_the_claim_takes_what_the_model_takes(store: SqlStore, scenario: Scenario) -> None:
    await play(store, scenario)
