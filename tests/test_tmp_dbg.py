import qdebug.stats as s, qdebug.tools.compare as c
def test_x():
    print(s.ErrorStats.update, c.ErrorStats.update, c.ErrorStats is s.ErrorStats)
    e = c.ErrorStats(); 
    import dataclasses; print(dataclasses.fields(e)[-1], e.__dict__.keys() if hasattr(e, "__dict__") else "slots")
