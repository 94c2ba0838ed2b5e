"""mtjax.observers: the one way a seam keeps, calls and removes its registered functions."""

from mtjax.observers import Observers


def test_observers_are_called_in_order_until_removed():
    seam, seen = Observers(), []
    assert not seam
    stop_a = seam.add(lambda *a: seen.append(("a", a)))
    seam.add(lambda *a: seen.append(("b", a)))
    assert seam
    seam(1, "x")
    stop_a()
    seam(2)
    assert seen == [("a", (1, "x")), ("b", (1, "x")), ("b", (2,))]


def test_through_passes_a_value_along_the_chain():
    seam = Observers()
    assert seam.through(3, "part") == 3  # none registered: unchanged
    seam.add(lambda part, v: v + len(part))
    stop = seam.add(lambda part, v: v * 10)
    assert seam.through(3, "part") == 70
    stop()
    assert seam.through(3, "part") == 7


def test_a_function_may_remove_itself_while_called():
    seam, seen = Observers(), []

    def once(x):
        seen.append(x)
        stop()

    stop = seam.add(once)
    seam(1)
    seam(2)
    assert seen == [1]
