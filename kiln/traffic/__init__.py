"""What was served (no torch): one record per finished request (`records`: the recent-request ring and
the recorder that fans a record out), the durable request log (`request_log`), the conversation a
served completion answered (`conversations`, what corrections read), and served traffic exported as
training data (`export`). The server's one traffic observer (kiln.api.observer) hands finished and
refused requests to the recorder; corrections, the stats routes and `kiln requests export` read what
it kept.

Imports: kiln.core, kiln.store, kiln.data (row formats), kiln.config / kiln.errors; never torch,
engine, train or api.
"""
