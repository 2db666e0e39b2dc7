"""Rotation-before-thresholding (LaRoSa) estimate for SmolLM2, numpy only (no graph built).

On the calibration inputs that scripts/frontier.py caches (2,048 rows per gated input), the
relative output error ||(X Q ⊙ dropped) Q^T W||² / ||X W||² at 30/40/50% sparsity, byte-weighted
over the decoder layers, for: plain |x| gating; a per-layer PCA rotation Q (LaRoSa; in a graph it
is an extra K x K product per layer: +95% of a layer's weight bytes at M = 1); and the rotations a
graph gets for free — one residual-stream rotation (RMSNorm gains folded into the next weights)
for q/k/v and gate/up, and a per-KV-group rotation of the attention output folded into v_proj and
o_proj. PCA is fitted on rows 0-1023 and evaluated on rows 1024-1535.

    python scripts/frontier_rotation.py
"""
import pickle, os, re, numpy as np
from safetensors.numpy import load_file
C=os.path.expanduser("~/.cache/ortsparse/frontier")  # scripts/frontier.py caches there
inputs=pickle.load(open(f"{C}/smollm2_inputs.pkl","rb")); units=pickle.load(open(f"{C}/smollm2_probed_l2_512_0.02.pkl","rb"))
sd=load_file(os.path.expanduser("~/.cache/ortsparse/models/smollm2/hf/model.safetensors"))
S=(0.3,0.4,0.5)
def err(x, W, s, T=None, Tinv=None):
    xs = x if T is None else x @ T
    Ws = W if Tinv is None else Tinv @ W
    sc=np.abs(xs); out=[]
    dense=np.sum((x@W)**2)
    for v in s:
        t=np.quantile(sc, v)
        out.append(np.sum((np.where(sc>=t,0,xs)@Ws)**2)/dense)
    return np.array(out)
def pca(x):
    w,v=np.linalg.eigh(x.T.astype(np.float64)@x); return v[:,::-1].astype(np.float32)
# global residual rotation from all normalized residual inputs
norm_inputs={}
for u in units:
    m=re.search(r"layers\.(\d+)/(self_attn/q_proj|mlp/gate_proj)",u.name)
    if m:
        key=f"model.layers.{m.group(1)}."+("input_layernorm.weight" if "attn" in m.group(2) else "post_attention_layernorm.weight")
        norm_inputs[u.input_name]=sd[key].astype(np.float32)
rng=np.random.default_rng(0)
pool=np.concatenate([inputs[n][:1024]/g for n,g in norm_inputs.items()])
Qg=pca(pool[rng.choice(len(pool),20000,replace=False)])
tot={k:np.zeros(3) for k in ("plain","pca","global","heads")}; wsum=0
for u in units:
    x=inputs[u.input_name]; fit,ev=x[:1024],x[1024:1536]
    Q=pca(fit)
    for L in u.layers:
        W=L.weight; b=L.weight_bytes
        if L.role=="head": continue
        e0=err(ev,W,S); e1=err(ev,W,S,Q,Q.T)
        if u.input_name in norm_inputs:
            g=norm_inputs[u.input_name]; T=(1/g)[:,None]*Qg; Tinv=Qg.T*g[None,:]
            e2=err(ev,W,S,T,Tinv)
        elif L.role=="out":
            # per kv-group rotation of the attention output (9 heads x 64, 3 groups)
            R=np.zeros((576,576),np.float32)
            for grp in range(3):
                heads=[grp*3+i for i in range(3)]
                pooled=np.concatenate([fit[:,h*64:(h+1)*64] for h in heads])
                q=pca(pooled)
                for h in heads: R[h*64:(h+1)*64,h*64:(h+1)*64]=q
            e2=err(ev,W,S,R,R.T)
        else:
            e2=e0
        tot["plain"]+=b*e0; tot["pca"]+=b*e1; tot["global"]+=b*e2; wsum+=b
        if (L.block_index or 0) in (0,1,15,29) and L.role in ("q","out","up","down"):
            print(L.name[-34:], "plain",np.round(e0,4),"pca",np.round(e1,4),"free",np.round(e2,4))
for k,v in tot.items(): print(k, np.round(v/wsum,5))
