"""Engines: the OpenAI HTTP adapter, process supervision, the simulator and a fake."""
