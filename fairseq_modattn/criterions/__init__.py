from . import label_smoothed_cross_entropy_with_aux  # noqa: F401  (registers the criterion)
