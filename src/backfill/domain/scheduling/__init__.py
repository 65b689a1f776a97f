"""The scheduler's policy, pure: who is served next and how much each engine takes.

- ``fair_share``: the weighted split of one claim between orgs' lanes;
- ``claim_model``: one whole claim (the turn, each lane's chunk, the credit gate, the split,
  the virtual-time step, the level of a lane that reopens), the reference for the SQL claim;
- ``planning``: rates, deadlines and earliest-deadline-first urgency (``plan``);
- ``concurrency``: how many requests a shared engine takes (AIMD on its pressure);
- ``locality``: which replica a line goes to, by its prompt prefix.

The database's claim statement (``adapters/db/claims.py``) is the fast path of the same rules,
pinned to ``claim_model`` by ``tests/contract/test_claim_model.py``.
"""
