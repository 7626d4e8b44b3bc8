"""Error measures shared by the GPU tests (pytest puts this folder on sys.path)."""


def rel_err(x, ref) -> float:
    """Relative L2 error ‖x − ref‖ / ‖ref‖, computed in float64."""
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()
