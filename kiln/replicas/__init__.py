"""Replicas: other inference servers (Kiln, vLLM, any OpenAI-compatible one) that this Kiln drives.

Kiln does not become a distributed system of its own: the replicas are engines that already scale, and
this package only knows them (`spec`, `registry`: `[[replicas]]` in the config plus the ones added over
the API, persisted under <data_dir>/replicas), watches them (`health`: a background poller reading
/health, /v1/models and, for a Kiln replica, /v1/config; `compat`: does it serve our base model),
and sends them adapters in their native way (`push`, `publish`). Evals fan out over them through
kiln.evals.fanout, which knows nothing of this package.
"""
