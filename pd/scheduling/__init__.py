"""A request's life in the engine: the request and its sampling parameters, the scheduler
and its PD part, fair share, prompt sources, the scheduler-runner outputs, and the
connector API."""
