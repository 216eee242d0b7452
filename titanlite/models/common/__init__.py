"""What the model families share: the decoder they configure (`decoder`: the block and the model around
it), its grouped-query attention (`grouped_query_attention`), attention masks for packed documents
(`attention`), the parameter initialisation that gives every parallel layout the same weights (`init`),
and the layers several families build from (`norm`: RMSNorm; `feed_forward`: SwiGLU; `moe`,
`moe_balance`, `moe_decoder`: the mixture-of-experts layer, its load balancing and decoder). A family's own
modules live in `models/<name>/`."""
