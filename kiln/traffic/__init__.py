"""What was served (no torch): one record per finished request (`records`: the recent-request ring and
the recorder that fans a record out), the durable request log (`request_log`), and served traffic
exported as training data (`export`). The request path hands finished completions to the recorder;
corrections, the stats routes and `kiln requests export` read what it kept.

Imports: kiln.core, kiln.store, kiln.data (row formats), kiln.config / kiln.errors; never torch,
engine, train or api.
"""
