"""`videosparse.processors.forward_args.forward_arg`: an argument by keyword first, else at its position, else None."""

from videosparse.processors.forward_args import forward_arg


def test_an_argument_given_by_keyword_wins_over_a_positional_one_at_its_index():
    x, other = object(), object()
    assert forward_arg((other,), {"hidden_states": x}, "hidden_states", 0) is x
    assert forward_arg((other, x), {}, "encoder_hidden_states", 1) is x


def test_an_argument_past_the_positional_ones_is_none():
    x = object()
    assert forward_arg((x,), {}, "encoder_hidden_states", 1) is None
    assert forward_arg((), {}, "hidden_states", 0) is None
    assert forward_arg((x, x), {}, "timestep", 5) is None
