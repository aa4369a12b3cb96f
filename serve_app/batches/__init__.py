"""OpenAI's Batch API over the durable jobs: the objects (:mod:`.models`) and their storage
in the job store's Redis (:mod:`.store`).

Pure: pydantic and redis-py's asyncio client (no Ray, FastAPI or torch); the routes and the
driver that runs a batch's lines as jobs live in :mod:`deployments.http`.
"""
