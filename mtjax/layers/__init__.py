"""What a decoder layer is made of (`spec`) and the kinds of its parts (`registry`).

    spec      LayerSpec: a layer's token mixer, feed-forward, rope and norms, a hashable value
    registry  the mixer, feed-forward and router kinds a LayerSpec names, each one entry
"""
