"""How an engine is started: `engine_factory` builds one from an `EngineConfig`, `llm` runs it
in-process (the offline API), `core_process` runs it in its own process behind `ipc`."""
