"""paratrain: data, model and hyper-parameter parallel training of classic image classifiers."""

__version__ = "0.1.0"
