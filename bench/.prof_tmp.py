import cProfile, pstats, sys, torch, kvattn
sys.argv = ["x"]
dev = torch.device("cuda")
H, D, L = 4, 128, 16
kc = torch.randn(4, 2, 16, H, D, device=dev, dtype=torch.bfloat16)
dec = kvattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev), "NHD")
dec.plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
         torch.tensor([16], dtype=torch.int32), H, H, D, 16, q_data_type=torch.bfloat16)
qd = torch.randn(1, H, D, device=dev, dtype=torch.bfloat16)
for _ in range(100): dec.run(qd, kc)
torch.cuda.synchronize()
pr = cProfile.Profile(); pr.enable()
for _ in range(1000): dec.run(qd, kc)
pr.disable(); torch.cuda.synchronize()
st = pstats.Stats(pr); st.sort_stats("tottime").print_stats(25)
