"""What the model families share: attention and its masks for packed documents (`attention`), the
parameter initialisation that gives every parallel layout the same weights (`init`), and the layers
several families build from (`norm`: RMSNorm; `feed_forward`: SwiGLU). A family's own modules live in
`models/<name>/`."""
