"""`pd bench simulate`: a discrete-event model of a PD fleet (see benchmarks/simulate.py)."""
