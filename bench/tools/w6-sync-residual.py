#!/usr/bin/env python3
"""What W6's clock missed while `birch sync` only fsynced the root directory (before 700221c):
per W6 step timed until durable (unpack, git clone, rm -rf), the time of step + `sync -f` +
`birch sync` of the binary under test, then one more `birch sync` of the fixed binary (after the
old one: the commit the old clock did not wait for; after the new one: about nothing). Old and
new runs alternate, each on a fresh 4 GiB image. Prints one JSON line per run.
Usage (root): BIRCH_OLD=PATH BIRCH_NEW=PATH W6N=10000 W6_TAR=TREE.tar W6_REPO=TREE.repo \
    bench/tools/w6-sync-residual.py REPS
W6_TAR and W6_REPO are the W6 tree's tarball and repository as the harness caches them
(`tree-N-s6-v1.tar`, `.repo` under its work directory). BENCHMARKS.md, W6, has the figures."""
import os, subprocess, sys, time, json
OLD=os.environ["BIRCH_OLD"]; NEW=os.environ["BIRCH_NEW"]
D=os.environ.get("W6_RESIDUAL_DIR", "/var/tmp/w6-sync-residual"); IMG=D+"/img"; MNT=D+"/mnt"
TAR=os.environ["W6_TAR"]; REPO=os.environ["W6_REPO"]
genv=dict(os.environ, HOME=D, GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL="/dev/null", LC_ALL="C")
os.makedirs(MNT, exist_ok=True)
def run(argv, **kw):
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, **kw)
def one(mode):
    binp = OLD if mode=="old" else NEW
    run([binp,"mkfs","--force","--size","4G",IMG])
    run([binp,"mount",IMG,MNT])
    res={}
    try:
        wd=MNT+"/w"; os.mkdir(wd)
        run(["sync","-f",wd]); run([NEW,"sync",MNT])   # start clean
        steps=[("unpack",["tar","-xf",TAR,"-C",wd],None),
               ("clone",["git","clone","-q","--no-hardlinks","file://"+REPO,wd+"/clone"],genv),
               ("rm",["rm","-rf",wd+"/tree"],None)]
        for name,argv,env in steps:
            t0=time.perf_counter()
            run(argv, env=env)
            run(["sync","-f",wd]); t1=time.perf_counter()
            run([binp,"sync",MNT]); t2=time.perf_counter()
            run([NEW,"sync",MNT]); t3=time.perf_counter()   # residual: old leaves work; new: ~nothing
            res[name]=dict(step=t1-t0, birch_sync=t2-t1, timed=t2-t0, residual=t3-t2)
    finally:
        subprocess.run([binp,"umount",MNT])
        for _ in range(50):
            if not os.path.ismount(MNT) and subprocess.run(["pgrep","-f",IMG],stdout=subprocess.DEVNULL).returncode!=0: break
            time.sleep(0.2)
    return res
out=[]
for rep in range(int(sys.argv[1])):
    for mode in (["old","new"] if rep%2==0 else ["new","old"]):
        r=one(mode); out.append(dict(rep=rep,mode=mode,**r))
        print(json.dumps(out[-1]), flush=True)
