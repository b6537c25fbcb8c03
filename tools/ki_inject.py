"""A KeyboardInterrupt at every line and call of shmkv's code, one at a time, on one operation.

Usage: python tools/ki_inject.py OP [OP ...], OP in truncate, truncate_deep, extend, copy,
create, fork, free (env FROM/TO: the range of injection points; SHMKV_SHARE=0: sharing off).
For each point N it makes a scene (a finished donor, a borrower A of it, an empty B), runs OP
with a trace function raising KeyboardInterrupt at the N-th line/call event inside shmkv, then
checks every live sequence's keys against its token ids (K = 4 * token + layer), the operated
sequence (before or after, and its write handle can extend and read back right), a new sequence
on recycled cells and the donor. It prints each point with a problem and the shmkv frames where
the interrupt was raised. The trace ignores ``@critical`` (shmkv defers a real SIGINT there), so
points inside critical frames are not reachable by a real Ctrl-C, nor is the line event of a
``with`` statement's exit (raised there, ``__exit__`` is never called; CPython 3.11 checks for
signals only at the callee's first instruction, inside ``__exit__``, which is critical). Session
33: truncate points 140-142 are such artifacts (``Structural.__exit__`` never ran); no point
reachable by a real SIGINT showed a problem on truncate, extend, copy or free.
Removes only the stores it created."""
# ruff: noqa
import sys, numpy as np, shmkv, os
from shmkv.testing import unique_name
L,H,D=3,2,16
WHERE=[None]
def kv(toks):
    t=np.asarray(toks,np.float32); k=np.empty((L,len(t),H,D),np.float32)
    for l in range(L): k[l]=(4*t+l)[:,None,None]
    return k,-k
def _stack(f):
    out=[]
    while f is not None and '/shmkv/' in f.f_code.co_filename:
        out.append(f); f=f.f_back
    return out
class Inject:
    def __init__(s,n): s.n=n; s.c=0; s.fired=False
    def __call__(s,frame,event,arg):
        if event in ('call','line') and frame.f_code.co_filename.find('/shmkv/')>=0:
            s.c+=1
            if s.c==s.n:
                s.fired=True
                s.where=[(f.f_code.co_filename.split('/shmkv/')[-1], f.f_lineno, f.f_code.co_name) for f in _stack(frame)]
                raise KeyboardInterrupt
            return s
        return None
def check(st,sid,h,cands,tag):
    toks=[int(x) for x in np.asarray(st.sequence(sid).tokens)]
    if toks not in cands: return f"{tag}: tokens {toks[:5]}..{len(toks)} not before/after"
    k=np.asarray(st.sequence(sid).keys(1)); want=kv(toks)[0][1]
    if not np.array_equal(k,want): return f"{tag}: keys wrong len {len(toks)}"
    if h is not None:
        own=[int(x) for x in np.asarray(h.tokens)]
        if own!=toks: return f"{tag}: handle tokens {len(own)} vs {len(toks)}"
        # can the handle append?
        try:
            nk,nv=kv([999]); h.extend(nk,nv,tokens=[999])
            toks2=toks+[999]
            k=np.asarray(st.sequence(sid).keys(1))
            if not np.array_equal(k,kv(toks2)[0][1]): return f"{tag}: after extend keys wrong"
        except shmkv.ShmkvError as e: return f"{tag}: extend after: {type(e).__name__} {e}"
    return None
def scene(op,n):
    st=shmkv.create(unique_name("kii"),layers=L,kv_heads=H,head_dim=D,dtype="float32",max_tokens=8192,max_seqs=16)
    try:
        P=list(range(1,201))
        d=st.create_sequence(capacity=512,prefix=P); k,v=kv(P); d.extend(k,v,tokens=P); d.finish()
        a=st.create_sequence(capacity=512,prefix=P[:150]+[5000]); 
        t=list(np.asarray(a.tokens)); more=[6000+i for i in range(20)]; k,v=kv(more); a.extend(k,v,tokens=more)
        before=[int(x) for x in np.asarray(a.tokens)]
        b=st.create_sequence(capacity=512,prefix=[7000]); 
        cands={'truncate':[before,before[:60]],'truncate_deep':[before,before[:5]],'copy':[[7000][:0] if False else [int(x) for x in np.asarray(b.tokens)],before[:100]],'free':[before]}.get(op)
        inj=Inject(n)
        new=[8000+i for i in range(30)]
        if op=='extend': cands=[before,before+new]
        sys.settrace(inj)
        try:
            tgt=(a.id,a) if op not in ('copy','create','fork') else ((b.id,b) if op=='copy' else None)
            if op=='truncate': cands=[before,before[:60]]; a.truncate(60); tgt=(a.id,a)
            elif op=='truncate_deep': cands=[before,before[:5]]; a.truncate(5); tgt=(a.id,a)
            elif op=='extend': new=[8000+i for i in range(30)]; k,v=kv(new); cands=[before,before+new]; a.extend(k,v,tokens=new)
            elif op=='copy': st.copy_prefix(a.id,b.id,100); tgt=(b.id,b)
            elif op=='create': cands=None; st.create_sequence(capacity=512,prefix=P[:180]+[1]); tgt=None
            elif op=='fork': cands=None; a.fork(90); tgt=None
            elif op=='free': cands=[before]; a.free(); tgt=(a.id,a)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        if not inj.fired: return 'done'
        WHERE[0]=inj.where
        errs=[]
        # all live seqs content check
        for info in st.sequences():
            toks=[int(x) for x in np.asarray(st.sequence(info.id).tokens)]
            kk=np.asarray(st.sequence(info.id).keys(1))
            if not np.array_equal(kk,kv(toks)[0][1]): errs.append(f"seq {info.id} keys wrong")
        if tgt is not None and op!='free':
            e=check(st,tgt[0],tgt[1],cands,op)
            if e: errs.append(e)
        if op=='free':
            ids={i.id for i in st.sequences()}
            if a.id in ids:
                e=check(st,a.id,a,cands,op)
                if e: errs.append(e)
        # a new seq on recycled cells reads own bytes
        g=st.create_sequence(capacity=512,prefix=[9999]); nn=[9000+i for i in range(40)]; k,v=kv(nn); g.extend(k,v,tokens=nn)
        toks=[int(x) for x in np.asarray(g.tokens)]
        if not np.array_equal(np.asarray(g.keys(1)),kv(toks)[0][1]): errs.append("new seq keys wrong")
        if not np.array_equal(np.asarray(d.keys(1)),kv(P)[0][1]): errs.append("donor changed")
        return errs
    finally:
        st.close()
        try: shmkv.remove(st.name)
        except shmkv.StoreNotFound: pass
for op in sys.argv[1:]:
    n=int(os.environ.get('FROM','1'))
    while n<int(os.environ.get('TO','100000')):
        r=scene(op,n)
        if r=='done': print(op,'calls',n-1); break
        if r: print(op,n,r,WHERE[0])
        n+=1
