"""Durable asynchronous inference jobs: the Redis store (:mod:`.store`, its scripts in
:mod:`.lua`, the job as read in :mod:`.view`) and a local Redis server (:mod:`.embedded`).

Pure storage: no Ray, FastAPI or torch; the routes and workers that use it live elsewhere.
"""
